"""Files the course writes (lab records, an incident's dumps and weights): each written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(partial)`` fills a temporary file beside ``path``; flushed to disk, it is renamed over ``path``
    (os.replace is atomic on one file system), and the rename flushed too (sync_folder). A full disk, an error or a
    rank killed mid-write leaves the previous file whole and never a cut one under the real name; an error also
    removes the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(partial)
        with open(partial, "rb") as written:
            os.fsync(written.fileno())
        os.replace(partial, path)
        sync_folder(path.parent)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def sync_folder(folder) -> None:
    """Flush ``folder``'s entries to disk: a rename inside it survives a power cut only once its folder is synced."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
