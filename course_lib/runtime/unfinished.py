"""Work a rank function starts in the background and returns without waiting for (an asynchronous checkpoint
save: course_lib.checkpoint_commit.PendingSave). The rank's loop (rank_process) finishes it when the function
returns, before it replies: the world that work writes with may end next, and its thread with it. The runtime
knows only that each piece has ``result()``, which waits for it, ``done()``, and ``close()``, which lets go of what
it holds once done (a save's own process group), and says what it is when printed; the technique that starts one
adds it here, and takes it off when someone waits for it."""

from __future__ import annotations

_UNFINISHED: set = set()          # this process's background work that nobody has waited for yet
_ABANDONED: list = []             # work a failed function left: closed once done, never waited for


def add(work) -> None:
    """Hold ``work`` until someone calls its result() (then ``discard`` it) or the rank function returns."""
    _UNFINISHED.add(work)


def discard(work) -> None:
    _UNFINISHED.discard(work)


def finish() -> list[str]:
    """Wait for every piece of work nobody waited for (a piece that failed raises its error here) and return what
    each was, to report."""
    _close_abandoned()
    finished = []
    while _UNFINISHED:
        work = _UNFINISHED.pop()
        work.result()
        finished.append(str(work))
    return finished


def abandon() -> None:
    """Forget every piece nobody waited for: the function that started it failed, its peers may be gone, and
    waiting for it could hang. Its thread finishes or fails on its own (an asynchronous save whose writes all
    finish is whole, and commits; one that does not leaves the checkpoint before it). The next function's pieces
    are then its own. What an abandoned piece holds is let go of here, or at a later finish or abandon, once it is
    done: in this thread, never from the piece's own."""
    _ABANDONED.extend(_UNFINISHED)
    _UNFINISHED.clear()
    _close_abandoned()


def _close_abandoned() -> None:
    for work in [work for work in _ABANDONED if work.done()]:
        _ABANDONED.remove(work)            # first: a close that fails is not tried again
        work.close()
