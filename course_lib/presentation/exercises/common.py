"""What every checker shares: the "not done yet" words, running a learner's function on ranks with a
timeout, and the wrapper that offers the reference answer after a miss."""

import functools
import threading

from ...runtime.launch import RankError, RankTimeout, launch

NOT_DONE = "Not done yet: replace `raise NotImplementedError` with your code, then run this cell again."
TIMEOUT_SECONDS = 30.0     # a checker's ranks take well under a second: still running after this, they hang
NOTICE_SECONDS = 3.0       # ranks still running after this long: say that the checker is waiting for them


def exercise(check):
    """Mark ``check`` as the checker of exercise ``check_<name>``: after an answer that did not pass, say how
    to see the reference answer (the notebooks never show it unless the learner asks)."""
    name = check.__name__.removeprefix("check_")

    @functools.wraps(check)
    def checked(*args, **kwargs) -> bool:
        given = args[0] if args else next(iter(kwargs.values()), None)
        if callable(given):
            passed = check(*args, **kwargs)
        else:   # a learner who passed a value, or called their function: one line, not a traceback
            print(f"✗ check_{name} takes your function itself, e.g. check_{name}(my_function) with no () after its "
                  f"name; it got {type(given).__name__} {given!r:.40}")
            passed = False
        if not passed:
            print(f"  stuck? run exercises.solution({name!r}) to see a reference answer")
        return passed
    return checked


def unfinished(err: RankError) -> bool:
    return "NotImplementedError" in err.summary


def run_on_ranks(trial, world_size: int, what: str = "function", timeout: float | None = None,
                  explain=None, **kwargs):
    """Run ``trial`` on ``world_size`` ranks and return their results; on a failure print what happened and
    return None. ``explain(summary)`` may return a better message for an error it recognises."""
    timeout = timeout or TIMEOUT_SECONDS
    # A hang would show nothing until the timeout: say after a few seconds that the ranks are still running
    # (from a timer thread, so that it speaks even while the ranks start).
    notice = threading.Timer(NOTICE_SECONDS, print, [f"waiting for {world_size} ranks… (a hang is reported "
                                                     f"after {timeout:g} s)"], {"flush": True})
    notice.start()
    try:
        return launch(trial, world_size, timeout=timeout, **kwargs)
    except RankTimeout as err:
        where = "\n".join(f"--- where rank {r} was ---\n{err.stacks.get(r, '(no stack)').rstrip()}"
                          for r in err.ranks)
        print(f"Your {what} did not finish within {timeout:g} s: ranks {err.ranks} were still running (a "
              f"collective that not every rank called, or a loop that never ends?), and were stopped.\n{where}")
    except RankError as err:
        message = explain and explain(err.summary)
        print(NOT_DONE if unfinished(err) else message or f"Your {what} failed on {err}")
    finally:
        notice.cancel()
    return None
