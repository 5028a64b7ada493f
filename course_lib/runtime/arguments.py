"""Command-line arguments checked before anything starts: one place for the labs and ``python -m course_lib.virtual``.

Each function here is an argparse ``type``: it turns the text typed into a value, or refuses it with a sentence
that names the value and the rule. argparse then prints one line (``error: argument --tp: 0 is below 1: ...``)
after the usage and exits with code 2, before any process starts, instead of a traceback from N ranks.

    parser.add_argument("--tp", type=integer(1))
    parser.add_argument("--lr", type=real(above=0))
    parser.add_argument("--out", type=writable_folder)

The functions' own arguments are checked here too, by the same rules: check_whole, check_number, and
check_sendable (what a launch or a world sends to its ranks).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Callable

import cloudpickle

# The largest world that `python -m course_lib.virtual` models. Its fake groups cost ~0.8 KB of memory per rank
# (0.8 GB per million), so a typo such as 1000000000 would grow without bound; the largest training clusters
# reported so far hold ~100,000 GPUs, and 2**17 = 131,072 covers them.
MAX_VIRTUAL_WORLD = 2**17
# Micro-batches per step for the virtual rank: each is traced once (~0.06 s for a 70B layer stack here), so
# 100,000 of them ran for ~95 minutes; real pipelines use tens to a few hundred per step.
MAX_VIRTUAL_MICROBATCHES = 1024


def integer(low: int | None = None, high: int | None = None, *, multiple_of: int = 1):
    """A whole number in [low, high] (either end open when None), a multiple of ``multiple_of``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}: it must be at least {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} is above {high}: it must be at most {high}")
        if value % multiple_of:
            raise argparse.ArgumentTypeError(f"{value} is not a multiple of {multiple_of}")
        return value
    parse.__name__ = "integer"
    return parse


def real(*, above: float | None = None, at_least: float | None = None, below: float | None = None):
    """A finite number (never nan or inf), ``> above`` / ``>= at_least`` / ``< below`` where given."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{value:g} must be more than {above:g}")
        if at_least is not None and not value >= at_least:
            raise argparse.ArgumentTypeError(f"{value:g} must be at least {at_least:g}")
        if below is not None and not value < below:
            raise argparse.ArgumentTypeError(f"{value:g} must be less than {below:g}")
        return value
    parse.__name__ = "number"
    return parse


def writable_folder(text: str) -> Path:
    """A folder results can be written to, checked now rather than after a long run, and not made yet: a later
    argument may still be refused, and a refused command leaves nothing behind. The folder, or the nearest of its
    parents that exists, must be a folder this user may write into."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder: results are written into a folder")
    existing = next(parent for parent in (path.absolute(), *path.absolute().parents) if parent.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot make {text}: {existing} is a file")
    try:   # a file made and removed in what exists already (a permission check alone trusts root everywhere)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write into {text}: {error.strerror or error}") from None
    return path


# ------------------------------------------------------------------- the same rules for functions' arguments

def check_whole(name: str, value, low: int = 1) -> None:
    """A ValueError naming ``name`` unless ``value`` is an int (not a bool, not 1.5, not "4k") of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be a whole number >= {low}")


def is_number(value) -> bool:
    """A finite int or float, not a bool (True is an int to Python, and a share of 1 to nobody)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(name: str, value, *, above: float | None = None, at_least: float | None = None,
                 below: float | None = None) -> None:
    """A ValueError naming ``name`` unless ``value`` is a finite real number within the bounds given."""
    rules = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
             f"< {below:g}" if below is not None else ""]
    ok = (is_number(value) and (above is None or value > above) and (at_least is None or value >= at_least)
          and (below is None or value < below))
    if not ok:
        raise ValueError(f"{name}={value!r} must be a finite number {' and '.join(r for r in rules if r)}".rstrip())


def check_sendable(values: dict, fn: Callable | None = None) -> None:
    """A TypeError naming the first of ``values`` (or ``fn``) that cannot be sent to the ranks (a lock, an open
    file, a generator), so that nothing is sent or started for it."""
    named = ({f"the function {getattr(fn, '__name__', fn)}": fn} if fn is not None else {}) | values
    for name, value in named.items():
        try:
            cloudpickle.dumps(value)
        except Exception as error:   # pickle raises TypeError, PicklingError, AttributeError, ...
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise TypeError(f"{name} cannot be sent to the ranks ({reason}): send what it holds instead, or make it "
                            "on the ranks (in the function, or in a %%ranks cell)") from None
