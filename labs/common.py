"""What the labs share: their command line, the model they scale up, and who reports.

Each lab runs the same way on a laptop (``python labs/X.py``, gloo ranks via ``launch``) and on GPUs
(``torchrun --nproc-per-node 8 labs/X.py``, NCCL); ``--hidden`` and ``--layers`` grow the tiny model for a GPU.
"""

import argparse
import os
from pathlib import Path

RESULTS = Path(os.path.relpath(Path(__file__).parent / "results"))  # printed as the reader would type it


def lab_parser(doc: str, *, world_size: int = 2, steps: int = 20, lr: float = 1e-2) -> argparse.ArgumentParser:
    """The arguments every lab takes; a lab adds its own (batch sizes, buckets, ...)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", world_size)),
                        help="ranks to start here (under torchrun: its WORLD_SIZE)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--hidden", type=int, help="model width (default: the tiny model's 64)")
    parser.add_argument("--layers", type=int, help="number of layers (default: the tiny model's 4)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="default: NCCL when every local rank has a GPU, else gloo")
    return parser


def model_overrides(args) -> dict:
    """Changes to the tiny model's config: --layers, and --hidden in the tiny model's proportions
    (course_lib.model.widened)."""
    from course_lib.model import widened

    overrides = {"max_seq_len": max(64, args.seq_len)}
    if args.layers:
        overrides["num_layers"] = args.layers
    if args.hidden:
        overrides.update(widened(args.hidden))
    return overrides


def reports() -> bool:
    """Rank 0 prints the table and writes the files (under torchrun every process runs main)."""
    return int(os.environ.get("RANK", 0)) == 0
