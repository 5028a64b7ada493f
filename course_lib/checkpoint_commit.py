"""How a checkpoint becomes visible only when it is whole, and why it then never loads as something else.

A save is never seen half done. Every rank writes into ``<path>.partial``; once all of them have written and rank
0 has written DCP's .metadata, rank 0 renames it to ``<path>``: a rename is atomic, so ``<path>`` is either the
last complete checkpoint or the new complete one, never a mix (DCP writes in place: a rank killed while
overwriting a folder left it with half its files of the new step, and load said nothing). Overwriting moves the
old folder aside to ``<path>.replaced`` first and removes it after; if a crash falls between those two renames,
``load`` and ``latest`` read ``<path>.replaced``, which is still whole. An asynchronous save commits the same way
when its writes finish; one that never finishes is never committed, and the old checkpoint stays. A rank
function that returns before its asynchronous save has finished is not allowed to lose it: the course's rank
process waits for every unfinished save of the function (runtime.unfinished) before it replies, and says so.

A save replaces or removes only folders the course made: ``<path>``, ``<path>.partial`` and ``<path>.replaced``
are each refused by name unless they hold the course's MARKER (every save writes it first) or its CHECKSUMS. One
save runs at a time: a save first waits for an asynchronous one still writing. An asynchronous save runs DCP's
collectives on a gloo group of its own, in its background thread, so that they never pair with the collectives
training issues meanwhile on the default group.

Each committed checkpoint lists the SHA-256 of every file it holds (CHECKSUMS), written before the rename:
``load`` checks them first, and refuses a changed file by name. The saved ``train`` entries carry the model's
config; ``load`` reads them first (a few bytes) and refuses a checkpoint of another model, naming each field
that differs: the same weights' shapes are not enough (8 heads of 8 and 4 heads of 16 have the same shapes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import torch.distributed as dist

from .runtime import unfinished
from .runtime.files import sync_folder, write_atomically

PARTIAL, REPLACED, CHECKSUMS, MARKER = ".partial", ".replaced", "checksums.json", ".made-by-course-checkpoint"


def check_ours(path: str) -> None:
    """Refuse, naming it, a folder a save of ``path`` would replace or remove that the course did not make."""
    for folder in (path, path + PARTIAL, path + REPLACED):
        ours = os.path.isdir(folder) and any(os.path.exists(os.path.join(folder, name)) for name in (MARKER, CHECKSUMS))
        if os.path.lexists(folder) and not ours:
            raise ValueError(f"{folder} exists and course_lib.checkpoint did not make it (no {MARKER} or {CHECKSUMS} "
                             "in it): a save replaces only its own checkpoints; move it, or save elsewhere")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checksums(folder: str) -> None:
    """Every file of a committed checkpoint as it was written (its SHA-256 in CHECKSUMS), or a ValueError naming
    the file: a flipped byte must not load as weights."""
    listed = os.path.join(folder, CHECKSUMS)
    if not os.path.exists(listed):
        raise ValueError(f"{folder}: no {CHECKSUMS} (not saved by course_lib.checkpoint.save, or not committed)")
    with open(listed) as sums:
        for name, digest in json.load(sums).items():
            if _sha256(os.path.join(folder, name)) != digest:
                raise ValueError(f"{os.path.join(folder, name)} is corrupted: its SHA-256 differs from the one saved")


class PendingSave:
    """dcp.async_save's future, committed by rank 0 as soon as its writes are done (on rank 0, done means every
    rank's file and the .metadata are written): rank 0's ``result()`` returns once it is, another rank's once its
    own writes are; each closes the save's own group. The next save or load waits for every rank's, then meets
    the others at a barrier: rank 0 has committed by then."""

    def __init__(self, future, staging: str, path: str, commits: bool, group=None):
        self._future, self._staging, self.path, self._group = future, staging, path, group
        self._lock, self._committed = threading.Lock(), not commits
        unfinished.add(self)                  # waited for when the rank function returns, if not before
        future.add_done_callback(self._commit_when_done)

    def _commit_when_done(self, future) -> None:
        with self._lock:
            if not self._committed and future.exception() is None:
                commit(self._staging, self.path)
                self._committed = True

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None):
        value = self._future.result(timeout)
        self._commit_when_done(self._future)
        unfinished.discard(self)
        self.close()
        return value

    def close(self) -> None:
        """Close the save's own group, once it is done (by result(), or by the runtime for a failed function's),
        unless the world's rebuild (a rank died) has destroyed it with every other group."""
        group, self._group = self._group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except ValueError:             # torch: "Invalid process group specified", gone already
                pass

    def __str__(self) -> str:
        return f"the asynchronous save of {self.path}"


def commit(staging: str, path: str) -> None:
    """Make the complete checkpoint in ``staging`` the one at ``path`` (an old one moved aside, then removed),
    with a checksum of every file (CHECKSUMS) written before it becomes visible. A commit tried again (after an
    error) lists the same files: never CHECKSUMS itself."""
    sums = {name: _sha256(os.path.join(staging, name)) for name in sorted(os.listdir(staging)) if name != CHECKSUMS}
    write_atomically(Path(staging, CHECKSUMS), lambda partial: partial.write_text(json.dumps(sums, indent=1)))
    if os.path.exists(path):
        shutil.rmtree(path + REPLACED, ignore_errors=True)
        os.rename(path, path + REPLACED)
    os.rename(staging, path)
    sync_folder(os.path.dirname(os.path.abspath(path)))     # the renames on disk before the old one goes
    shutil.rmtree(path + REPLACED, ignore_errors=True)


def committed(path: str) -> str:
    """The folder that holds the committed checkpoint ``path``: itself, or, if a commit was cut between its two
    renames, the old one moved aside (``path``.replaced, still whole). Raises FileNotFoundError naming ``path``."""
    for candidate in (path, os.path.normpath(path) + REPLACED):
        if os.path.exists(os.path.join(candidate, ".metadata")):
            return candidate
    raise FileNotFoundError(f"no complete checkpoint at {path} (no .metadata: never saved, or its save was cut)")


def config_text(config) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True) if config is not None else ""


def check_same_model(path: str, expected: str, saved: str) -> None:
    """Refuse a checkpoint of another model, naming each field that differs (same shapes are not enough: 8 heads
    of 8 and 4 heads of 16 have the same weights' shapes)."""
    if not expected or not saved or expected == saved:
        return
    ours, theirs = json.loads(expected), json.loads(saved)
    fields = [f"{name}={theirs.get(name)!r} (this model: {ours.get(name)!r})" for name in sorted(set(ours) | set(theirs))
              if ours.get(name) != theirs.get(name)]
    raise ValueError(f"{path} holds another model: {', '.join(fields)}")
