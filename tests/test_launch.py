"""The launcher: results, output, errors that name the rank, timeouts, and no process left behind."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, gone, run_cell, wait_for_pids
from course_lib import RankError, RankTimeout, WorkerGroup, device, launch
from course_lib.runtime.launch import GroupNotFormed
from course_lib.runtime.tracebacks import WaitLine
from course_lib.runtime.workers import check_world_fits, max_local_ranks

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks


def rank_sum(rank, world_size, offset=0):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, world_size, t.item()


def test_results_come_back_in_rank_order_after_a_real_all_reduce():
    results = launch(rank_sum, 4, offset=10)
    assert results == [(r, 4, 0 + 1 + 2 + 3 + 4 * 10) for r in range(4)]


def test_functions_are_shipped_by_value_closures_and_lambdas_too():
    secret = torch.arange(3.0)  # captured by the closure: travels with it

    def scaled(rank, world_size):
        return (secret * rank).tolist()

    assert launch(scaled, 2) == [[0.0, 0.0, 0.0], [0.0, 1.0, 2.0]]
    assert launch(lambda rank, world_size: rank * world_size, 3) == [0, 3, 6]


def test_each_rank_gets_a_fair_share_of_threads_and_its_device():
    cores = len(os.sched_getaffinity(0))
    results = launch(lambda rank, world_size: (torch.get_num_threads(), str(device()), dist.get_backend()), 2)
    assert results == [(max(1, cores // 2), "cpu", "gloo")] * 2


def test_each_rank_output_is_shown_with_its_rank(capsys):
    def talk(rank, world_size):
        print(f"hello from {rank}")
        print("to stderr", file=sys.stderr)
        os.write(1, b"raw fd write\n")  # C-level output is relayed too

    launch(talk, 2)
    out, err = capsys.readouterr()
    for r in range(2):
        assert f"[rank {r}] hello from {r}\n" in out
        assert f"[rank {r}] raw fd write\n" in out
        assert f"[rank {r}] to stderr\n" in err


def test_a_long_line_without_a_newline_arrives_whole_even_split_inside_a_character(capsys):
    """600 KB in one line, written in pieces of 7 bytes (so the pipe's chunks end inside a 2-byte character),
    the newline only at the end: relayed as one line, every character whole."""
    def long_line(rank, world_size):
        text = ("aé" * 200_000).encode()
        for start in range(0, len(text), 7):
            os.write(1, text[start:start + 7])
        os.write(1, b"\n")

    launch(long_line, 1)
    assert capsys.readouterr().out.count("[rank 0] " + "aé" * 200_000 + "\n") == 1


def test_grouped_output_shows_each_ranks_last_lines_and_says_how_many_it_left_out():
    """A %%ranks cell's block per rank holds its last 1,000 lines, each cut at 10,000 characters: what a redraw
    sends stays the same size however long the cell prints."""
    from course_lib.runtime.magics import GroupedOutput

    output = GroupedOutput([0, 1], refresh_seconds=1e9)
    for i in range(5000):
        output.add(0, "stdout", f"line {i}\n")
    output.add(1, "stdout", "x" * 50_000 + "\n")
    text = output.text()
    assert "… 4,000 earlier lines not shown (the last 1,000 are)\nline 4000\n" in text and "line 3999\n" not in text
    assert "x" * 10_000 + "… (40,000 more characters)\n" in text and len(text) < 40_000


def test_a_failing_rank_is_named_with_its_traceback_while_peers_wait_in_a_collective():
    def fail_on_two(rank, world_size):
        if rank == 2:
            raise ValueError("rank two is unhappy")
        dist.all_reduce(torch.ones(1))  # the others block here until rank 2's failure reaches them

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fail_on_two, 4)
    # a cold forkserver start alone can take 4 s on a busy machine; launch's own timeout is 120 s
    assert time.monotonic() - start < 20, "a crash must surface in seconds, not after a collective's timeout"
    err = info.value
    assert err.rank == 2
    assert "ValueError: rank two is unhappy" in str(err)
    assert 'raise ValueError("rank two is unhappy")' in err.remote_traceback  # the source line itself
    assert "fail_on_two" in err.remote_traceback
    assert "course_lib/runtime/workers.py" not in err.remote_traceback  # only the learner's frames


def test_a_rank_that_dies_without_a_word_is_named_with_its_exit():
    def die(rank, world_size):
        if rank == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(RankError, match=r"rank 1: the process died \(exit code 3\)") as info:
        launch(die, 2)
    assert info.value.rank == 1

    def killed(rank, world_size):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(RankError, match="SIGKILL") as info:
        launch(killed, 2)
    assert info.value.rank == 0


def test_a_hung_rank_is_stopped_by_the_timeout_with_where_it_was():
    def skip_collective_on_one(rank, world_size):
        if rank != 1:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins: ranks 0 and 2 wait forever
        return rank

    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launch(skip_collective_on_one, 3, timeout=1.5)
    assert time.monotonic() - start < 15    # 1.5 s, then the stacks; not the default 120 s
    assert info.value.ranks == [0, 2]
    assert str(info.value).startswith("ranks [0, 2] did not finish within 1.5 s (a collective")
    for r in (0, 2):
        assert "in all_reduce" in info.value.stacks[r] and "skip_collective_on_one" in info.value.stacks[r]


def test_a_paused_rank_is_called_paused_and_ended_with_the_others():
    """A rank stopped by SIGSTOP cannot print its stack: the timeout says it was paused and how to resume one,
    and the paused process is ended like the others."""
    def pause_one(rank, world_size):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.barrier()

    with pytest.raises(RankTimeout) as info:
        launch(pause_one, 2, timeout=1.5)
    assert "(stopped: its process" in info.value.stacks[1] and "kill -CONT" in info.value.stacks[1]


def test_launch_works_again_after_failures():
    with pytest.raises(RankError):
        launch(lambda rank, world_size: 1 / 0, 2)
    assert launch(rank_sum, 2) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_an_unpicklable_result_is_an_error_naming_the_rank_and_what_could_not_be_sent():
    import threading

    with pytest.raises(RankError) as info:
        launch(lambda rank, world_size: threading.Lock() if rank == 0 else 1, 2)
    assert info.value.rank == 0
    assert info.value.summary.startswith("UnsendableResult: rank 0 returned a lock that could not be sent back to "
                                         "the notebook (TypeError: cannot pickle '_thread.lock' object)")
    assert "cloudpickle" not in str(info.value), str(info.value)   # none of the pickler's frames


def test_what_cannot_be_sent_is_named_before_any_rank_starts(monkeypatch):
    import threading

    import course_lib.runtime.launch as launcher

    def no_group(*args, **kwargs):
        raise AssertionError("a group of ranks was started for a task that cannot be sent")
    monkeypatch.setattr(launcher, "WorkerGroup", no_group)
    guard = threading.Lock()
    with pytest.raises(TypeError, match=r"^guard cannot be sent to the ranks \(cannot pickle '_thread.lock'"):
        launch(rank_sum, 2, guard=guard)
    with pytest.raises(TypeError, match=r"^the function <lambda> cannot be sent to the ranks \(cannot pickle"):
        launch(lambda rank, world_size: guard.locked(), 2)


def test_a_failed_launch_keeps_no_pipe_open():
    """Each failed launch kept 2 pipes per rank and one more (5 for 2 ranks) until the garbage collector ran: its
    traceback holds the group. Now the group lets go of them as it ends."""
    import gc

    def open_pipes():
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))
    launch(rank_sum, 2)   # the forkserver's own pipes, once
    gc.disable()
    try:
        before = open_pipes()
        for _ in range(3):
            with pytest.raises(RankError):
                launch(lambda rank, world_size: 1 / 0, 2)
        assert open_pipes() == before
    finally:
        gc.enable()


@pytest.mark.parametrize("bad", [0, -1, float("inf"), "10"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_before_any_rank_starts(bad):
    with pytest.raises(ValueError, match=f"timeout={bad!r} must be a finite number > 0"):
        launch(rank_sum, 2, timeout=bad)


def start_a_sleep(rank, world_size, folder, fail):
    """Starts `sleep 300` (it joins this rank's process group), notes its pid, then returns or fails."""
    child = subprocess.Popen(["sleep", "300"])
    (folder / str(child.pid)).touch()
    if fail and rank == 1:
        raise ValueError("rank 1 fails after starting a sleep")
    return child.pid


@pytest.mark.parametrize("fail", [False, True])
def test_what_a_rank_started_is_stopped_with_it_on_success_and_on_failure(tmp_path, fail):
    if fail:
        with pytest.raises(RankError, match="rank 1 fails"):
            launch(start_a_sleep, 2, folder=tmp_path, fail=True)
    else:
        launch(start_a_sleep, 2, folder=tmp_path, fail=False)
    sleeps = [int(path.name) for path in tmp_path.iterdir()]
    assert len(sleeps) >= 1 + (not fail)   # with a failure, rank 0 may be stopped before it started its sleep
    assert gone(sleeps, within=5), "a rank's `sleep 300` outlived it"


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_bad_world_size_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"world_size={bad!r}"):
        launch(rank_sum, bad)


def test_the_most_ranks_a_machine_runs_is_the_least_of_its_cores_memory_and_a_cap():
    GiB = 2**30
    assert max_local_ranks(cpus=2, memory_bytes=8 * GiB) == 16        # 8 per core
    assert max_local_ranks(cpus=16, memory_bytes=2 * GiB) == 8        # 250 MiB each: 2048 // 250 = 8
    assert max_local_ranks(cpus=64, memory_bytes=1024 * GiB) == 128   # the cap
    assert max_local_ranks(cpus=1, memory_bytes=100 * 2**20) == 1     # one rank always fits


def test_a_world_far_beyond_the_machine_is_refused_with_the_rule_and_what_the_machine_has():
    with pytest.raises(ValueError) as info:
        check_world_fits(17, cpus=2, memory_bytes=8 * 2**30)
    assert str(info.value) == (
        "world_size=17 is more than this machine can run: it has 2 CPU cores and 8.0 GiB of memory, enough for "
        "16 ranks (the least of 8 ranks per core: 16; one rank per 250 MiB: 32; and 128). A larger world runs "
        "under torchrun, across machines; any one rank of it runs here on a fake group (course_lib.virtual).")
    check_world_fits(16, cpus=2, memory_bytes=8 * 2**30)   # the limit itself is allowed


def test_launch_refuses_a_world_far_beyond_this_machine_before_starting_anything():
    cores = len(os.sched_getaffinity(0))
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"world_size=1000 is more than this machine can run: it has {cores} CPU "
                                         r"cores and [\d.]+ GiB of memory, enough for \d+ ranks"):
        launch(rank_sum, 1000)
    assert time.monotonic() - start < 1   # refused at once: not one process was started


class RankOneAstray(WorkerGroup):
    """Rank 1 looks for the rendezvous on a port where nobody listens, so it never joins."""
    nobody_listens_here = 0          # set by the test
    started: list[int] = []          # the process ids, to check that none is left

    def _start_rank(self, rank, generation=0):
        store_port = self.store_port
        if rank == 1:
            self.store_port = self.nobody_listens_here
        try:
            super()._start_rank(rank, generation)
        finally:
            self.store_port = store_port
        self.started.append(self.procs[rank].pid)


def test_a_group_that_does_not_form_is_reported_as_that_with_the_ranks_that_never_joined(capsys):
    with socket.socket() as bound_only:   # bound, never listening: a connection to it is refused
        bound_only.bind(("127.0.0.1", 0))
        RankOneAstray.nobody_listens_here = bound_only.getsockname()[1]
        with pytest.raises(GroupNotFormed) as info:
            RankOneAstray(3, form_timeout=3)
    assert str(info.value) == ("the process group did not form within 3 s: ranks [1] never joined (ranks [0, 2] "
                               "waited for them in init_process_group); every rank process was stopped")
    assert info.value.never_joined == [1] and info.value.waited == [0, 2]
    assert len(RankOneAstray.started) == 3 and gone(RankOneAstray.started)
    out = capsys.readouterr().out   # the wait was visible: one line, rewritten in place, then ended
    assert "\rforming the process group: 2 of 3 ranks arrived (" in out and out.endswith("\n")


def test_a_wait_line_is_silent_when_short_and_rewritten_in_place_when_long(capsys):
    quick = WaitLine(after=60)
    quick.show("waiting")
    quick.end("done")
    assert capsys.readouterr().out == ""
    slow = WaitLine(after=0)
    slow.show("forming the process group: 1 of 2 ranks arrived")
    slow.end("formed")
    first = "forming the process group: 1 of 2 ranks arrived (0 s)"
    assert capsys.readouterr().out == "\r" + first + "\r" + "formed (0 s)".ljust(len(first)) + "\n"


def test_bad_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="backend='mpi'"):
        launch(rank_sum, 2, backend="mpi")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank: 64 ranks"):
            launch(rank_sum, 64, backend="nccl")


def test_a_worker_group_runs_task_after_task_and_keeps_state_on_request():
    def remember(rank, world_size):
        # Functions arrive by value with fresh globals each time; the process (its environment) persists.
        os.environ["COUNTER"] = str(int(os.environ.get("COUNTER", "0")) + 1)
        return int(os.environ["COUNTER"])

    with WorkerGroup(2, exit_after_error=False) as group:
        assert group.run(remember) == [1, 1]
        assert group.run(remember) == [2, 2]
        assert group.run(remember, ranks=[1]) == [3]
        with pytest.raises(RankError):
            group.run(lambda rank, world_size: 1 / 0, ranks=[0])
        assert group.alive() == [True, True]  # the failing rank kept its state
        assert group.run(remember) == [3, 4]


# ---------------------------------------------------------------------------- torchrun and Jupyter

SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from course_lib import launch

    def fn(rank, world_size, scale):
        t = torch.tensor([float(rank)]) * scale
        dist.all_reduce(t)
        return os.getpid(), t.item()

    if __name__ == "__main__":
        results = launch(fn, int(os.environ.get("WORLD_SIZE", 2)), scale=10)
        pids = {pid for pid, _ in results}
        print(f"rank {os.environ.get('RANK', 'notebook')}: sums={[s for _, s in results]} processes={len(pids)}")
""")


def test_the_same_script_runs_under_torchrun_and_on_its_own(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(torchrun + [str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for r in range(2):  # under torchrun each process is a rank and gets every rank's result
        assert f"rank {r}: sums=[10.0, 10.0] processes=2" in out.stdout
    alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert alone.returncode == 0, alone.stderr
    assert "rank notebook: sums=[10.0, 10.0] processes=2" in alone.stdout


def test_torchrun_with_a_different_world_size_is_refused(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.replace('int(os.environ.get("WORLD_SIZE", 2))', "4"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(torchrun + [str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0
    assert "launch(world_size=4) but torchrun started WORLD_SIZE=2" in out.stderr


SLEEPER = """
import os, time
from course_lib import launch
def sleeper(rank, world_size):
    print(os.getpid(), flush=True)
    time.sleep(600)
launch(sleeper, 3)
"""


def test_jupyter_stop_button_stops_every_rank_and_the_kernel_stays_usable(kernel):
    km, kc = kernel
    msg_id = kc.execute(SLEEPER)
    pids = wait_for_pids(kc, msg_id, 3)
    assert len(pids) == 3
    km.interrupt_kernel()  # what the stop button does: SIGINT to the kernel's process group
    text, ename = run_cell(kc, None, msg_id=msg_id)
    # One line that says what happened, none of the launcher's frames (workers.py, selectors, ...):
    assert ename == "Interrupted" and "KeyboardInterrupt: launch() was interrupted: its 3 ranks were stopped" in text
    assert not any(word in text for word in ("Traceback", "workers.py", "selectors", "launch.py")), text
    assert gone(pids), "workers survived an interrupt"
    out, ename = run_cell(kc, "print(launch(lambda rank, world_size: rank, 2))")
    assert ename is None and "[0, 1]" in out


def test_killing_the_kernel_takes_the_workers_with_it(kernel):
    km, kc = kernel
    msg_id = kc.execute(SLEEPER)
    pids = wait_for_pids(kc, msg_id, 3)
    assert len(pids) == 3
    km.shutdown_kernel(now=True)  # SIGKILL: no Python cleanup runs in the kernel
    assert gone(pids), "workers outlived their kernel"


NODE = """
import sys
import torch.distributed as dist
from course_lib import launch
from course_lib.runtime.launch import nodes
print(launch(lambda rank, world_size: dist.get_world_size(), 2), nodes())
"""


def test_nodes_started_with_different_arguments_are_named_before_any_work(tmp_path):
    """Two "nodes" (one rank each, as torchrun starts them: RANK, WORLD_SIZE, MASTER_ADDR/PORT set) with
    different arguments stop at once, each naming the rank and machine that differ, instead of hanging in a
    collective until the group's timeout; with the same arguments they run and name their machine."""
    script = tmp_path / "node.py"
    script.write_text(NODE)

    def start(rank, port, *argv):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
        return subprocess.Popen([sys.executable, str(script), *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def free_port():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    port = free_port()
    nodes = [start(0, port, "--hidden", "1024"), start(1, port, "--hidden", "2048")]
    outputs = [node.communicate(timeout=90) for node in nodes]
    host = socket.gethostname()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode != 0
        assert (f"ValueError: ranks [1] (on {host}) were started with the arguments ['--hidden', '2048'], rank 0 "
                f"(on {host}) with ['--hidden', '1024']: run the same command on every node") in err, err[-2000:]
    port = free_port()
    nodes = [start(0, port, "--hidden", "1024"), start(1, port, "--hidden", "1024")]
    for node in nodes:
        out, err = node.communicate(timeout=90)
        assert node.returncode == 0 and out.strip() == f"[2, 2] ['{host}']", err[-2000:]


def test_a_worker_already_reaped_is_not_signalled_by_its_old_pid(monkeypatch):
    """Once joined, a worker's pid is free for any new process: cleaning up after it must not send SIGKILL to it
    (its group, gone with it, is all kill_group may still signal)."""
    import multiprocessing

    from course_lib.runtime.processes import kill_group
    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    worker.start()
    worker.join()
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(pid))
    kill_group(worker)
    assert killed == []
