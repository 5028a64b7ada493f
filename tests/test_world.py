"""Persistent worlds: state between cells, pull/push, and faults that never hang the notebook.

The first half drives the ``World`` API directly; the second drives the ``%%ranks`` magics in a real Jupyter
kernel, the way a learner does (interrupts included).
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from conftest import REPO, gone, kill_session, processes_of_session, run_cell
from course_lib import RankError, RankTimeout, World
from course_lib.runtime.world import Interrupted

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks


@pytest.fixture(scope="module")
def world():
    with World(4) as w:
        yield w


def values(outcome):
    return [r.value for r in outcome.results]


def test_variables_persist_between_cells_and_collectives_work(world):
    world.exec("x = torch.full((2,), float(rank))")
    assert values(world.exec("x")) == [repr(torch.full((2,), float(r))) for r in range(4)]
    assert values(world.exec("dist.all_reduce(x)\nx.tolist()")) == ["[6.0, 6.0]"] * 4


def test_pull_and_push(world):
    world.push(lr=0.25)
    world.exec("y = torch.arange(3) * rank * lr")
    pulled = world.pull("y")
    assert [t.tolist() for t in pulled] == [[0.0, 0.25 * r, 0.5 * r] for r in range(4)]
    with pytest.raises(RankError, match="has no variable 'nope'"):
        world.pull("nope")
    import threading
    with pytest.raises(TypeError, match=r"^guard cannot be sent to the ranks \(cannot pickle '_thread.lock'"):
        world.push(lr=0.5, guard=threading.Lock())              # one line, and nothing sent
    assert world.pull("lr") == [0.25] * 4


def test_a_task_that_could_not_be_sent_does_not_count_its_cells_as_sent(world):
    """A cell's lines go to the ranks with the first task after it (for their tracebacks); a task that could not
    be pickled sent nothing, so they go with the next one."""
    import linecache
    import threading

    code = "def fails(rank, world_size, **unused):\n    raise ValueError('from the cell')\n"
    linecache.cache["<cell 1>"] = (len(code), None, code.splitlines(keepends=True), "<cell 1>")
    namespace = {}
    exec(compile(code, "<cell 1>", "exec"), namespace)
    try:
        with pytest.raises(TypeError, match="^guard cannot be sent to the ranks"):
            world.run(namespace["fails"], guard=threading.Lock())
        with pytest.raises(RankError) as info:
            world.run(namespace["fails"])
    finally:
        del linecache.cache["<cell 1>"]
    assert "raise ValueError('from the cell')" in str(info.value)


def test_only_some_ranks_run_a_cell(world):
    world.exec("mark = 'set'", ranks=[0, 2])
    outcome = world.exec("globals().get('mark', 'unset')")
    assert values(outcome) == ["'set'", "'unset'", "'set'", "'unset'"]
    with pytest.raises(ValueError, match=r"ranks \[7\] do not exist: this world has ranks 0..3"):
        world.exec("1", ranks=[7])


def test_output_arrives_per_rank(world):
    lines = []
    world.exec("print('from', rank)", on_output=lambda rank, stream, line: lines.append((rank, line)))
    assert sorted(lines) == [(r, f"from {r}\n") for r in range(4)]


def test_an_error_on_one_rank_keeps_everyone_state(world):
    world.exec("kept = rank * 10")
    outcome = world.exec("if rank == 3:\n    raise KeyError('only three')\n")
    assert outcome.world == "ok"  # nobody was left waiting: no repair needed
    assert outcome.error.rank == 3 and "KeyError: 'only three'" in str(outcome.error)
    assert "line 2" in outcome.error.remote_traceback
    assert "raise KeyError('only three')" in outcome.error.remote_traceback  # the cell's own line
    assert world.pull("kept") == [0, 10, 20, 30]


def test_peers_blocked_in_all_reduce_when_a_rank_fails_are_freed_and_the_world_recovers(world):
    world.exec("z = torch.ones(1) * (rank + 1)\nbefore = z.clone()")
    start = time.monotonic()
    outcome = world.exec("if rank == 1:\n    raise ValueError('rank one fails')\ndist.all_reduce(z)")
    assert time.monotonic() - start < 30    # seconds when quiet; a group timeout would be minutes
    assert outcome.error.rank == 1 and "ValueError: rank one fails" in str(outcome.error)
    assert outcome.world == "recovered", outcome.note
    assert "stuck in a collective" in outcome.note and "variables are kept" in outcome.note
    assert [t.item() for t in world.pull("before")] == [1.0, 2.0, 3.0, 4.0]  # state kept
    assert values(world.exec("w = torch.ones(1)\ndist.all_reduce(w)\nw.item()")) == ["4.0"] * 4  # new group works
    assert world.status()["generation"] >= 1


def test_a_collective_one_rank_skips_times_out_and_recovers(world):
    start = time.monotonic()
    outcome = world.exec("if rank != 2:\n    dist.barrier()", timeout=1)
    assert time.monotonic() - start < 30    # seconds when quiet; a group timeout would be minutes
    assert isinstance(outcome.error, RankTimeout) and outcome.error.ranks == [0, 1, 3]
    assert "in barrier" in outcome.error.stacks[0]
    assert outcome.world == "recovered"
    assert values(world.exec("dist.barrier()\nrank")) == ["0", "1", "2", "3"]


def test_a_rank_that_never_returns_is_interrupted(world):
    world.exec("keep = rank")
    outcome = world.exec("while True:\n    pass", timeout=1)
    assert isinstance(outcome.error, RankTimeout) and outcome.error.ranks == [0, 1, 2, 3]
    # SIGINT reached the Python loop: nothing else to repair ("ok"); on a busy machine a rank may answer only
    # after the others were made to leave the group ("recovered"). Either way no rank was restarted:
    assert outcome.world in ("ok", "recovered"), outcome.note
    assert world.pull("keep") == [0, 1, 2, 3]


def test_a_rank_that_dies_mid_cell_is_named_and_started_again_and_the_others_keep_their_variables():
    with World(2) as w:
        w.exec("kept = rank")
        old_pids = w.status()["pids"]
        outcome = w.exec("import os\nif rank == 0:\n    os._exit(7)\ndist.barrier()")
        assert outcome.error.rank == 0 and "exit code 7" in str(outcome.error)
        assert outcome.world == "recovered" and "ranks [0] died and were started again" in outcome.note, outcome.note
        status = w.status()
        assert all(status["alive"]) and status["pids"][1] == old_pids[1] and status["pids"][0] != old_pids[0]
        assert values(w.exec("dist.barrier()\nglobals().get('kept', 'lost')")) == ["'lost'", "1"]
    assert gone(old_pids)


def kill(world, rank):
    """SIGKILL to ``rank``, and wait until the world can know it: multiprocessing hears of a death from the
    forkserver, which reaps the process (a few ms later, seconds on a busy machine)."""
    os.kill(world.status()["pids"][rank], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while world.status()["alive"][rank] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not world.status()["alive"][rank]


def test_a_rank_killed_by_sigkill_between_cells_is_named_and_started_again():
    """What the out-of-memory killer does: SIGKILL, no word from the rank. The next cell says which rank died and
    how, starts it again in a fresh group with the others, and runs (not a BrokenPipeError from its pipe)."""
    with World(3) as w:
        w.exec("kept = rank")
        old_pids = w.status()["pids"]
        kill(w, 1)
        outcome = w.exec("dist.barrier()\nglobals().get('kept', 'lost')")
        assert outcome.error is None and values(outcome) == ["0", "'lost'", "2"]
        assert outcome.world == "recovered" and outcome.note.startswith(
            "ranks [1] had died (rank 1: exit code -9, killed by SIGKILL (a kill -9 or the out-of-memory killer)) and were started again"), \
            outcome.note
        assert w.status()["generation"] == 1 and w.status()["pids"][0::2] == old_pids[0::2]
        kill(w, 2)                                               # run(), pull() and push() recover the same way
        assert w.run(lambda rank, world_size: dist.get_world_size() + rank) == [3, 4, 5]
    assert gone(old_pids)


def test_a_stopped_world_closes_its_store():
    w = World(2)
    port = w.group.store_port
    socket.create_connection(("127.0.0.1", port), timeout=5).close()   # it listens while the world runs
    w.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_a_bad_timeout_is_refused_before_any_rank_runs(world):
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match=f"timeout={bad!r} must be a finite number > 0"):
            world.exec("1", timeout=bad)


def test_an_interrupt_stops_every_rank_and_says_in_a_sentence_what_became_of_the_world(world):
    world.exec("kept = rank")
    # A shell's background job (nohup ... &, as a CI runner may start the suite) ignores SIGINT, where a kernel
    # reacts to it: be the kernel here, whatever started the tests.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()   # the stop button, a second in
        with pytest.raises(Interrupted) as info:
            world.exec("import time\ntime.sleep(60)")
    finally:
        signal.signal(signal.SIGINT, previous)
    # Each rank was in Python's sleep, so the interrupt freed it at once and nothing was broken; on a busy
    # machine a rank may answer only after the others left the group, and the world then recovered.
    message = str(info.value)
    assert (message == "the ranks were interrupted; they kept their variables and are ready for the next cell"
            or message.startswith("the ranks were interrupted; the world recovered: ")), message
    assert world.pull("kept") == [0, 1, 2, 3]


def test_a_world_far_beyond_the_machine_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="world_size=1000 is more than this machine can run"):
        World(1000)


def test_push_before_any_cell_keeps_the_predefined_names():
    with World(2) as w:
        w.push(lr=0.5)
        assert [r.value for r in w.exec("(rank, world_size, lr)").results] == ["(0, 2, 0.5)", "(1, 2, 0.5)"]


def test_a_syntax_error_is_raised_before_any_rank_runs(world):
    with pytest.raises(SyntaxError):
        world.exec("def broken(:\n")


# --------------------------------------------------------------------- the magics, in a real kernel


def test_ranks_magics_step_through_cells(kernel):
    km, kc = kernel
    text, err = run_cell(kc, "%load_ext course_lib\n%ranks start 2")
    assert err is None and "2 ranks started (gloo)" in text
    text, err = run_cell(kc, "%%ranks\ng = torch.ones(2) * (rank + 1)\nprint('grad before', g.tolist())\ng")
    assert err is None
    assert "── rank 0 ──\ngrad before [1.0, 1.0]\nOut: tensor([1., 1.])" in text
    assert "── rank 1 ──\ngrad before [2.0, 2.0]\nOut: tensor([2., 2.])" in text
    text, err = run_cell(kc, "%%ranks\ndist.all_reduce(g)\ng /= world_size")
    assert err is None
    text, err = run_cell(kc, "%ranks pull g\nprint([t.tolist() for t in g])")
    assert err is None and "[[1.5, 1.5], [1.5, 1.5]]" in text
    text, err = run_cell(kc, "scale = 4\n%ranks push scale")
    text, err = run_cell(kc, "%%ranks --only 1\nprint(scale * rank)")
    assert err is None and "── rank 1 ──\n4" in text and "rank 0" not in text
    text, err = run_cell(kc, "%%ranks\nif rank == 0:\n    raise RuntimeError('rank zero is sad')\ndist.barrier()")
    assert err == "RankError"
    assert "rank 0: RuntimeError: rank zero is sad" in text
    assert "Cell In[" in text and "line 3" in text and "raise RuntimeError('rank zero is sad')" in text
    assert "The world recovered" in text
    text, err = run_cell(kc, "%%ranks\ng")  # state survived
    assert err is None and "Out: tensor([1.5000, 1.5000])" in text
    text, err = run_cell(kc, "%ranks stop\n%ranks status")
    assert "all ranks stopped" in text and "no ranks are running" in text
    text, err = run_cell(kc, "%%ranks\n1")
    assert "UsageError" in text and "%ranks start 4" in text
    text, err = run_cell(kc, "%ranks start 3\n%ranks status")
    assert err is None and text.count("alive") == 3


def test_ranks_usage_errors_are_clear(kernel):
    km, kc = kernel
    run_cell(kc, "%load_ext course_lib\n%ranks start 2")
    text, err = run_cell(kc, "%ranks frobnicate")
    assert "UsageError" in text and "unknown; use one of start, stop, status, pull, push" in text
    text, err = run_cell(kc, "%%ranks --only 0,x\n1")
    assert "UsageError" in text and "--only '0,x'" in text
    text, err = run_cell(kc, "%%ranks --only 5\n1")
    assert "UsageError" in text and "ranks [5] do not exist" in text
    text, err = run_cell(kc, "%ranks push not_defined_here")
    assert "UsageError" in text and "no variable not_defined_here" in text
    text, err = run_cell(kc, "%ranks start 0")
    assert "UsageError" in text and "argument world_size: 0 is below 1: it must be at least 1" in text
    text, err = run_cell(kc, "%%ranks --timeout 0\n1")
    assert "UsageError" in text and "argument --timeout: 0 must be more than 0" in text


def test_the_stop_button_interrupts_every_rank_and_the_world_stays_usable(kernel):
    km, kc = kernel
    run_cell(kc, "%load_ext course_lib\n%ranks start 3")
    run_cell(kc, "%%ranks\nx = torch.ones(1) * rank")
    # rank 0 sleeps in Python; ranks 1 and 2 block in an all_reduce waiting for it
    msg_id = kc.execute("%%ranks\nimport time\nif rank == 0:\n    time.sleep(60)\ndist.all_reduce(x)")
    time.sleep(1.5)
    start = time.monotonic()
    km.interrupt_kernel()
    text, err = run_cell(kc, None, msg_id=msg_id)
    assert err == "Interrupted" and "KeyboardInterrupt: the ranks were interrupted; the world recovered" in text
    assert time.monotonic() - start < 30    # seconds when quiet; a group timeout would be minutes
    text, err = run_cell(kc, "%%ranks\nw = torch.ones(1)\ndist.all_reduce(w)\n(w.item(), rank)")
    assert err is None and all(f"Out: (3.0, {r})" in text for r in range(3))


def test_killing_the_kernel_leaves_no_ranks_behind(kernel):
    km, kc = kernel
    run_cell(kc, "%load_ext course_lib\n%ranks start 3")
    text, _ = run_cell(kc, "%ranks status")
    pids = [int(word) for word in text.split() if word.isdigit() and int(word) > 100]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    km.shutdown_kernel(now=True)
    assert gone(pids), "ranks outlived their kernel"


def test_ranks_stay_interruptible_when_started_from_a_background_job():
    """A shell starts background jobs (CI, nohup) with SIGINT ignored; the ranks must still be interruptible."""
    script = ("from course_lib import World\n"
              "with World(2) as world:\n"
              "    print(world.exec('while True:\\n    pass', timeout=1).world)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.returncode == 0 and out.stdout.split()[-1] == "ok", out.stdout + out.stderr[-2000:]


KERNEL = """
import subprocess, sys, time
from course_lib import World, launch
how, folder = sys.argv[1], sys.argv[2]
BUSY = f'''
import subprocess
subprocess.Popen(["sleep", "300"])
open("{folder}/" + str(rank), "w").close()
while True:
    pass
'''
def busy(rank, world_size):
    exec(BUSY, {"rank": rank})
if how == "World":
    World(4).exec(BUSY)
else:
    launch(busy, 4, timeout=600)
"""


@pytest.mark.parametrize("how", ["World", "launch"])
def test_killing_a_kernel_with_busy_ranks_leaves_none_of_its_processes(tmp_path, how):
    """kill -9 of a kernel (here a python process) whose 4 ranks compute and each started a `sleep 300`: within
    10 s nothing it started is left, neither the ranks, nor what they started, nor multiprocessing's forkserver."""
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, how, str(tmp_path)], start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 4 and kernel.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.iterdir())) == 4, kernel.stderr.read().decode()[-2000:] if kernel.poll() else ""
        # the kernel, the forkserver, 4 ranks and their 4 sleeps are found (so an empty list below means gone)
        assert len(processes_of_session(kernel.pid)) >= 10
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait()
        deadline = time.monotonic() + 10
        while processes_of_session(kernel.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [" ".join(psutil.Process(pid).cmdline()) for pid in processes_of_session(kernel.pid)]
        assert left == [], f"left running 10 s after the kernel was killed: {left}"
    finally:
        kernel.kill()
        kill_session(kernel.pid)


def test_a_paused_rank_is_restarted_alone_and_the_others_keep_their_variables():
    """Rank 1 pauses itself (SIGSTOP) while rank 0 waits for it in a barrier. A paused process answers nothing,
    so it is ended at once, its peer's barrier fails fast, and only the paused rank starts again."""
    with World(2) as w:
        w.exec("kept = rank * 10")
        out = w.exec("import os, signal, torch.distributed as dist\nif rank == 1:\n"
                     "    os.kill(os.getpid(), signal.SIGSTOP)\ndist.barrier()", timeout=3)
        assert out.world == "recovered" and "ranks [1] died and were started again" in out.note, out.note
        assert "(stopped: its process" in out.timeout.stacks[1]
        assert w.run(lambda rank, world_size: rank) == [0, 1]
        assert w.pull("kept", ranks=[0]) == [0]
