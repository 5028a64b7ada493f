"""Shared by the tests: no worker may outlive a test, a real Jupyter kernel to drive like a learner, and
per-user files kept out of the user's home."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# Kernels (ours and nbval's), IPython and matplotlib keep per-user files under the home directory (profiles,
# runtime files, font caches). The tests give them a folder of their own, so a run neither reads the user's
# settings nor writes beside them. Set here, at import, so every kernel the session starts inherits it.
_HOME = tempfile.mkdtemp(prefix="course-tests-home-")
os.environ.update(IPYTHONDIR=f"{_HOME}/ipython", MPLCONFIGDIR=f"{_HOME}/matplotlib",
                  JUPYTER_CONFIG_DIR=f"{_HOME}/jupyter/config", JUPYTER_DATA_DIR=f"{_HOME}/jupyter/data",
                  JUPYTER_RUNTIME_DIR=f"{_HOME}/jupyter/runtime")
# ATEN_CPU_CAPABILITY=default (the suite's portable run) caps ATen's own kernels, not oneDNN's: on a CPU with AMX,
# bf16 CPU attention still asks oneDNN whether to pack its operands, and then calls ATen's AVX-512-only packing
# ("pack_vnni2 is only supported when avx512 is supported"). Cap oneDNN's instruction set the same way (before
# torch is imported, here and in every kernel and rank the tests start).
if os.environ.get("ATEN_CPU_CAPABILITY") in ("default", "avx2"):
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie; a process that exits while we look is not running."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_kept(process: psutil.Process) -> bool:
    try:
        return any(name in " ".join(process.cmdline()) for name in ("forkserver", "resource_tracker"))
    except psutil.NoSuchProcess:
        return True   # gone already: not a leftover


def workers_left() -> list[psutil.Process]:
    """Descendants of this process, except multiprocessing's forkserver and resource tracker (kept up)."""
    return [p for p in psutil.Process().children(recursive=True) if _running(p) and not _is_kept(p)]


def _pid_running(pid: int) -> bool:
    try:
        return _running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def gone(pids, within: float = 10) -> bool:
    """Wait until none of ``pids`` is running (a zombie counts as gone)."""
    deadline = time.monotonic() + within
    while any(_pid_running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(autouse=True)
def no_orphans():
    yield
    deadline = time.monotonic() + 10   # ends as soon as they are gone: ~0.1 s when quiet, seconds under load
    while workers_left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers_left() == [], "worker processes were left behind"


@pytest.fixture
def kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO))
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def run_cell(kc, code, timeout=60, msg_id=None):
    """Execute ``code`` in the kernel (or follow the already sent cell ``msg_id``) until it is idle.

    Returns (everything the cell showed as text, the error's name or None). A display that a cell updates
    in place (as ``%%ranks`` does) counts once, with its final content.
    """
    msg_id = msg_id or kc.execute(code)
    shown, ename = {}, None
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            shown[len(shown)] = content["text"]
        elif kind in ("display_data", "update_display_data", "execute_result"):
            key = content.get("transient", {}).get("display_id") or len(shown)
            shown[key] = content["data"].get("text/plain", "")
        elif kind == "error":
            ename = content["ename"]
            shown[len(shown)] = "\n".join(content["traceback"])
        elif kind == "status" and content["execution_state"] == "idle":
            return "\n".join(shown.values()), ename


def wait_for_pids(kc, msg_id, count, timeout=30):
    """Process ids that a running cell prints, one per line, until ``count`` of them arrived."""
    pids, deadline = set(), time.monotonic() + timeout
    while len(pids) < count and time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id:
            pids |= {int(w) for w in msg["content"]["text"].split() if w.isdigit() and int(w) > 100}
    return pids


def processes_of_session(session: int) -> list[int]:
    """Running processes of the session ``session`` (the process started with start_new_session=True and all
    it started, whichever process group each moved to and whoever its parent is now)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and _running(process):
                found.append(process.pid)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return found


def kill_session(session: int) -> None:
    """SIGKILL to whatever is left of a session (a failed test must not leave it running)."""
    for pid in processes_of_session(session):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def costed(config, mesh, *, gpu, **keywords):
    """cost.step_time of the Job these keywords describe (ZeRO-1 unless they say otherwise; interleaved when
    num_chunks > 1); the keywords that are the cost model's assumptions (cost.ASSUMPTIONS) go to step_time."""
    from course_lib.cost import ASSUMPTIONS, step_time
    from course_lib.job import Job

    assumptions = {key: keywords.pop(key) for key in list(keywords) if key in ASSUMPTIONS}
    keywords.setdefault("zero_stage", 1)
    if keywords.get("num_chunks", 1) > 1:
        keywords.setdefault("schedule", "interleaved")
    return step_time(Job(config, mesh, gpu=gpu, **keywords), **assumptions)
