"""Inside a rank: the loop a worker process runs, task after task, until the notebook closes its pipe.

``workers.WorkerGroup`` starts one such process per rank (through multiprocessing's forkserver) and talks to it
over a duplex pipe. First the rank joins the process group and says ``("ok", "joined")`` (or reports why it could
not). Then, task after task: a task is a cloudpickled ``(fn, kwargs, cell sources)``; the reply is
``("ok", value)`` or ``("error", when, summary, traceback)``. Everything here runs in the rank, never in the
notebook's kernel.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import io
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from . import unfinished
from .tracebacks import PLUMBING_FILES, skip_plumbing_frames

PLUMBING_FILES.add(__file__)  # a rank's traceback starts in the learner's code, not in the worker loop

LOOPBACK = "127.0.0.1"  # a local world is reachable from this machine only: the store and the ranks listen here
# A collective that waits longer than this fails instead of hanging. The notebook gives up on a task after its
# own (shorter) timeout and then interrupts or restarts the ranks; this is only the last resort.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def _loopback_interface() -> str:
    """The name of the loopback network interface: ``lo`` on Linux, ``lo0`` on macOS."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name in ("lo", "lo0")), "lo")


def destroy_group() -> None:
    """Leave this process's group, if it has one: its connections close, so peers waiting on it fail at once."""
    if dist.is_initialized():
        dist.destroy_process_group()


def worker_main(rank, world_size, backend, store_port, threads, exit_after_error, conn, out_w, err_w,
                notebook_alive, generation=0, store_key=""):
    # Our own process group: Jupyter's stop button signals the kernel's group, not ours; and whatever this rank
    # starts (a subprocess, a `sleep 300`) joins it, so the notebook ends them all with one killpg.
    os.setpgrp()
    # Interruptible whatever we inherited: a process started in the background by a shell (a CI job, nohup)
    # ignores SIGINT, and so would every rank, and World could then only restart a rank stuck in a loop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_notebook(notebook_alive)
    for fd, end in ((1, out_w), (2, err_w)):
        os.dup2(end.fileno(), fd)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), line_buffering=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)
    torch.set_num_threads(threads)
    _keep_freed_memory()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MPLBACKEND="Agg")  # figures go to the notebook
    # gloo listens on the address the host name resolves to: loopback on some machines, the network on many
    # others (CI runners, cloud VMs). All ranks of a local world are on this machine: keep them on loopback.
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        init_group(rank, world_size, backend, store_port, generation, store_key)
        dist.barrier()  # NCCL connects lazily, at the first collective: only this proves that the group works
    except Exception as exc:  # report a failed start like any other error
        _reply_error(conn, exc)
        return
    _send_uninterrupted(conn, cloudpickle.dumps(("ok", "joined")))  # the notebook waits for this from every rank
    while True:
        try:
            task = conn.recv_bytes()
        except KeyboardInterrupt:
            continue  # an interrupt meant for a task that had just finished
        except (EOFError, OSError):
            break  # the notebook closed the group
        try:
            fn, kwargs, sources = cloudpickle.loads(task)
            linecache.cache.update(sources)  # so tracebacks show the notebook cell's lines
            value = fn(rank, world_size, **kwargs)
            for work in unfinished.finish():
                print(f"rank {rank}: {work} had not finished when the function returned; waited for it (wait on "
                      "its result() before returning)", file=sys.stderr)
            reply = _pickled_result(rank, value)
        except BaseException as exc:  # KeyboardInterrupt too: the notebook should hear about it
            unfinished.abandon()
            _reply_error(conn, exc)
            if exit_after_error:
                os._exit(1)  # closing our sockets makes peers blocked in a collective fail fast
            continue
        _send_uninterrupted(conn, reply)
    destroy_group()


def arrival_key(rank: int, generation: int = 0, store_key: str = "") -> str:
    """The store key a rank sets as it reaches the rendezvous, before it joins the group."""
    return f"{store_key}/generation{generation}/arrived/{rank}"


def init_group(rank: int, world_size: int, backend: str, store_port: int, generation: int = 0,
               store_key: str = "") -> None:
    """Join the process group through the notebook's store. Every key starts with the world's ``store_key``, a
    random word only the notebook and its ranks know: the store listens on loopback without authentication,
    and another local process cannot set or delete keys it cannot name. A rebuilt group (after a failure left
    the old one broken) uses a fresh ``generation`` so its keys do not mix with the old group's."""
    store = dist.TCPStore(LOOPBACK, store_port, is_master=False)
    # Set before joining: if the group never forms, the notebook can tell the ranks that never reached the
    # rendezvous from those that came and waited for them.
    store.set(arrival_key(rank, generation, store_key), "")
    dist.init_process_group(backend, store=dist.PrefixStore(f"{store_key}/generation{generation}", store),
                            rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


def _send_uninterrupted(conn, data: bytes) -> None:
    """Send a reply whole: an interrupt in the middle of it would garble the pipe."""
    sys.stdout.flush()
    sys.stderr.flush()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        conn.send_bytes(data)
    except (OSError, ValueError):
        pass  # the notebook has gone
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _reply_error(conn, exc: BaseException) -> None:
    when = time.monotonic()  # one clock for all processes on this machine: the earliest error is the cause
    summary = f"{type(exc).__name__}: {exc}"
    tb = "".join(traceback.format_exception(type(exc), exc, skip_plumbing_frames(exc.__traceback__)))
    _send_uninterrupted(conn, cloudpickle.dumps(("error", when, summary, tb)))


class UnsendableResult(TypeError):
    """What a rank returned cannot travel back to the notebook (a lock, an open file, a generator...)."""


def _pickled_result(rank: int, value) -> bytes:
    """The reply for ``value``; an UnsendableResult naming the rank and the value's type if it cannot be pickled.
    Raised from None: cloudpickle's frames say nothing the learner can act on."""
    try:
        return cloudpickle.dumps(("ok", _to_cpu(value)))
    except Exception as error:
        raise UnsendableResult(
            f"rank {rank} returned a {type(value).__name__} that could not be sent back to the notebook "
            f"({type(error).__name__}: {error}); return tensors, numbers, strings, lists or dicts of them") from None


def _to_cpu(value):
    """Results travel to the notebook, which may have no GPU: bring tensors home first."""
    return torch.utils._pytree.tree_map(
        lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20          # the most glibc allows on 64-bit (4 MiB · sizeof(long))


def _keep_freed_memory() -> None:
    """Reuse freed memory instead of handing it back to the OS, as torch's CUDA caching allocator does on a GPU.

    glibc serves a large allocation (a layer's activations, a flat gradient) with a fresh mmap and unmaps it when
    freed, and returns the freed top of its heap to the OS. Each new buffer is then new pages, and the kernel
    zero-fills each page on first touch: measured here (a VM), writing a fresh 60 MB buffer took 25 ms, writing
    it again 2.7 ms. A training step allocates the same buffers every step, so it paid that every step, where
    a GPU reuses its cached blocks: ZeRO-3's gathered units and Adam's temporaries were several times slower
    than their bytes. Buffers up to 32 MiB now come from the heap, and the heap is not trimmed: freed memory
    is kept for the next step (the process's peak footprint stays reserved, as a GPU's cache does)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):            # not glibc (macOS, musl): its allocator as it is
        pass


def _die_with_notebook(notebook_alive) -> None:
    """End this rank, and everything it started, when the notebook's process ends, however it ends (kill -9
    included, where no cleanup of the notebook's runs).

    ``notebook_alive`` is the read end of a pipe whose only write end the notebook's process holds: nothing is
    ever written to it, so a read returns exactly when that process is gone (the OS closes its descriptors).
    A thread waits for that and kills our whole process group. ``PR_SET_PDEATHSIG`` alone cannot do this: our
    parent is multiprocessing's forkserver, not the notebook, and the forkserver outlives the notebook for as
    long as any rank lives (each rank holds the write end of the forkserver's own "alive" pipe). Once the ranks
    are gone, the forkserver sees that pipe close and exits too. PDEATHSIG stays, for a forkserver killed first.
    """
    def watch():
        try:
            notebook_alive.recv_bytes()
        except (EOFError, OSError):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="course_lib: watch the notebook", daemon=True).start()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
