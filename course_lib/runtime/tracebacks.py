"""What a learner reads from the machinery: the errors that name the ranks (RankError and its kin), a rank's
traceback as a learner wants to read it (the lines of their own notebook cell, short file names, none of the
machinery's frames), and the line that counts the ranks during a long start (WaitLine).

Code defined in a notebook cell travels to the ranks by value (cloudpickle), keeping its file name, and the
cell's source lines travel with it (IPython keeps them only in the kernel's ``linecache``), so a rank's
traceback shows ``Cell In[3], line 2`` and the line itself.
"""

from __future__ import annotations

import collections
import io
import linecache
import os
import re
import sys
import time
import types

import cloudpickle


class CodePickler(cloudpickle.Pickler):
    """cloudpickle, except that code keeps its file name (cloudpickle writes '<dynamic-code>'), so a
    rank's traceback can show the lines of the notebook cell or script the code came from."""

    dispatch_table = collections.ChainMap({types.CodeType: lambda code: _keep_filename(code)},
                                          cloudpickle.Pickler.dispatch_table)


def _keep_filename(code):
    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return make, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)


def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    CodePickler(buffer).dump(obj)
    return buffer.getvalue()


def user_frames(stack: str) -> str:
    """A faulthandler dump, cut where the learner's code was called from this module."""
    lines = stack.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if any(f'"{path}"' in line for path in PLUMBING_FILES):
            return "".join(lines[:i])
    return stack


def name_cells(text: str) -> str:
    """Shorter file names in a rank's traceback: 'Cell In[3]' (as IPython writes it) for the kernel's temporary
    file of a notebook cell, '.../site-packages/torch/...' for installed packages, 'course_lib/...' for ours."""
    text = re.sub(r'File "[^"]*/site-packages/', 'File ".../site-packages/', text)
    repository = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    text = text.replace(f'File "{repository}/', 'File "')  # course_lib/..., not a learner's own checkpoint.py
    try:
        from IPython import get_ipython
        compiler = get_ipython().compile
    except (ImportError, AttributeError):
        return text
    for filename in set(re.findall(r'File "([^"]+)"', text)):
        cell = compiler.format_code_name(filename) if hasattr(compiler, "format_code_name") else None
        if cell:
            text = text.replace(f'File "{filename}"', " ".join(cell))
    return text


def interactive_sources() -> dict:
    """Source lines of code typed into notebook cells (IPython keeps them in ``linecache`` only)."""
    return {name: entry for name, entry in linecache.cache.items()
            if len(entry) == 4 and entry[1] is None and not os.path.exists(name)}


PLUMBING_FILES: set[str] = set()  # modules whose frames a learner need not see (workers, world add themselves)


def skip_plumbing_frames(tb):
    """Start the traceback at the learner's code, not at the worker loop that called it."""
    while tb is not None and tb.tb_frame.f_code.co_filename in PLUMBING_FILES and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


class RankError(RuntimeError):
    """A rank failed. ``rank`` names it; ``remote_traceback`` is its traceback as text."""

    def __init__(self, rank: int, summary: str, remote_traceback: str = "", when: float = 0.0):
        self.rank, self.summary, self.remote_traceback = rank, summary, remote_traceback
        self.when = when  # time.monotonic() when it happened (one clock for the whole machine)
        text = f"rank {rank}: {summary}"
        if remote_traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def _render_traceback_(self):
        """What IPython shows: the rank's own traceback, not the launcher's frames that relayed it."""
        return [f"{type(self).__name__}: {self}"]


class RankTimeout(RankError):
    """Some ranks did not finish in time. ``ranks`` lists them; ``stacks`` maps each to where it was."""

    def __init__(self, ranks: list[int], timeout: float, stacks: dict[int, str]):
        self.ranks, self.stacks = ranks, stacks
        self.rank, self.remote_traceback, self.when = ranks[0], "", 0.0
        self.summary = f"did not finish within {timeout:g} s"
        RuntimeError.__init__(self, f"ranks {ranks} {self.summary} (a collective that not every rank called, "
                              "or a loop that never ends?)\n\n" + "\n".join(
                                  f"--- where rank {r} was ---\n{stacks.get(r, '(no stack)').rstrip()}" for r in ranks))


class GroupNotFormed(RuntimeError):
    """The ranks' processes started, but they did not all join one process group in time; all were stopped.

    ``never_joined``: ranks that never reached the rendezvous; ``waited``: ranks that came and waited for them.
    """

    def __init__(self, timeout: float, never_joined: list[int], waited: list[int]):
        self.never_joined, self.waited = never_joined, waited
        if never_joined:
            text = f"ranks {never_joined} never joined" + (
                f" (ranks {waited} waited for them in init_process_group)" if waited else "")
        else:
            text = f"every rank arrived, but ranks {waited} never got through init_process_group"
        super().__init__(f"the process group did not form within {timeout:g} s: {text}; every rank process "
                         "was stopped")

    def _render_traceback_(self):
        return [f"{type(self).__name__}: {self}"]


class Interrupted(KeyboardInterrupt):
    """The stop button stopped the ranks; the message says what became of them."""

    def _render_traceback_(self):  # IPython shows this instead of the frames of the machinery
        return [f"KeyboardInterrupt: {self}"]


class WaitLine:
    """One line of text that says what we are waiting for, rewritten in place (``\\r``) as it changes. Silent
    for waits shorter than ``after`` seconds, so that a quick start prints nothing."""

    def __init__(self, after: float = 2.0):
        self.start, self.after, self.width = time.monotonic(), after, 0

    def show(self, text: str) -> None:
        seconds = time.monotonic() - self.start
        if seconds >= self.after:
            line = f"{text} ({seconds:.0f} s)"
            sys.stdout.write("\r" + line.ljust(self.width))  # padded: a shorter line must cover a longer one
            sys.stdout.flush()
            self.width = max(self.width, len(line))

    def end(self, text: str = "") -> None:
        """Finish the line, if one was shown, with ``text`` (and the time) in its place."""
        if self.width:
            if text:
                self.show(text)
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.width = 0
