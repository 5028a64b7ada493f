"""What the labs share: their command line, the backend and precision they run in, and what they record.

Each lab runs the same way on a laptop (``python labs/X.py``, gloo ranks via ``launch``) and on GPUs
(``torchrun --nproc-per-node 8 labs/X.py``, NCCL, one GPU per rank); ``--hidden`` and ``--layers`` grow the
tiny model for a GPU. Every lab's JSON says where it ran (``backend``, ``device``, ``machine``, ``dtype``), so
that course_lib.presentation.lab_results never shows a CPU run as a GPU result.
"""

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
from pathlib import Path

import torch

from course_lib import device
from course_lib.runtime.arguments import integer, real, writable_folder
from course_lib.runtime.files import write_atomically
from course_lib.runtime.launch import nodes
from course_lib.runtime.workers import check_world_fits

RESULTS = Path(os.path.relpath(Path(__file__).parent / "results"))  # printed as the reader would type it


def lab_parser(doc: str, *, world_size: int = 2, steps: int = 20, lr: float = 1e-2,
               autocast: bool = True, min_steps: int = 1) -> argparse.ArgumentParser:
    """The arguments every lab takes; a lab adds its own (batch sizes, buckets, ...). ``autocast=False``: the
    lab fixes its own precision (ZeRO trains bf16 weights with MixedPrecisionAdam), so no --dtype. Every value is
    checked as it is read (course_lib.runtime.arguments): a bad one stops the lab with one line, exit code 2, before any
    process starts. ``min_steps``: labs that report a median over steps after the first need 2."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--world-size", type=integer(1), default=int(os.environ.get("WORLD_SIZE", world_size)),
                        help="ranks to start here (under torchrun: its WORLD_SIZE)")
    parser.add_argument("--steps", type=integer(min_steps), default=steps)
    parser.add_argument("--seq-len", type=integer(1), default=32)
    parser.add_argument("--lr", type=real(above=0), default=lr)
    parser.add_argument("--hidden", type=integer(16, multiple_of=16),
                        help="model width, a multiple of 16 (heads of 8 channels, 2 per key/value head; "
                             "default: the tiny model's 64)")
    parser.add_argument("--layers", type=integer(1), help="number of layers (default: the tiny model's 4)")
    parser.add_argument("--out", type=writable_folder, default=RESULTS,
                        help=f"where the JSON and PNG go (default: {RESULTS}, the results the notebooks show; "
                             "notebooks and tests write to a temporary folder)")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="default: nccl when every local rank has a GPU of its own, else gloo")
    parser.add_argument("--timeout", type=real(above=0),
                        help="seconds before unfinished ranks are stopped (default: 120 + 60 per step, so that a "
                             "long healthy run is not taken for a hang)")
    if autocast:
        parser.add_argument("--dtype", choices=("bf16", "fp32"),
                            help="bf16: matmuls in bfloat16 under torch.autocast, weights, gradients and optimizer "
                                 "in float32 (default with nccl); fp32: float32 throughout (default with gloo)")
    return parser


def parse(parser: argparse.ArgumentParser, argv=None, check=None) -> argparse.Namespace:
    """The lab's arguments, with the backend and dtype settled here, before any rank starts: a world that
    cannot run stops at once with a usage error, instead of in N processes. ``check(args)``, the lab's own
    rules between arguments (pp ≤ layers, say), raises ValueError for the same one-line error."""
    args = parser.parse_args(argv)
    try:
        if "RANK" not in os.environ:   # a world started here, not by torchrun: it must fit this machine
            check_world_fits(args.world_size)
        args.backend = choose_backend(args.backend, args.world_size)
        if check is not None:
            check(args)
        check_memory(args)
    except ValueError as error:
        parser.error(str(error))
    if hasattr(args, "dtype") and args.dtype is None:   # not given: what training on that device would use
        args.dtype = "bf16" if args.backend == "nccl" else "fp32"
    if args.timeout is None:   # a step of a lab takes well under a minute even at its widest suggested sizes
        args.timeout = 120.0 + 60.0 * args.steps
    return args


def check_memory(args) -> None:
    """The least a rank holds, against what it runs on, before any rank allocates: a typo (--hidden 65536,
    --layers 100000, --micro-batch-size 1000000000) is a one-line error, not an out-of-memory kill minutes later.
    The least: the whole model's fp32 weights (every rank builds it whole before any sharding, 4 bytes a
    parameter) and the activations of the rows one rank computes at once (ledger.gpt_activation_bytes, exact for
    the course model). Gloo ranks share this machine's memory; an NCCL rank has its GPU's."""
    from course_lib.ledger import gpt_activation_bytes
    from course_lib.model import param_count_formula, preset

    config = preset("tiny", **model_overrides(args))
    batch = getattr(args, "micro_batch_size", None) or getattr(args, "global_batch_size", None) or 1
    rows = batch if hasattr(args, "micro_batch_size") else max(1, batch // args.world_size)
    weights, activations = 4 * param_count_formula(config), gpt_activation_bytes(config, rows, args.seq_len)["total"]
    if args.backend == "nccl":
        if not torch.cuda.is_available():    # (only where device_count is pretended: the labs' tests)
            return
        ranks, have, where = 1, torch.cuda.get_device_properties(0).total_memory, "each GPU has"
    else:
        ranks, where = local_ranks(args.world_size), "this machine has"
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if ranks * (weights + activations) > have:
        raise ValueError(f"this run needs at least {ranks * (weights + activations) / 2**30:,.1f} GiB ({ranks} "
                         f"rank{'s' * (ranks > 1)} × {weights / 2**30:,.2f} GiB of fp32 weights + "
                         f"{activations / 2**30:,.2f} GiB of activations for {rows:,} rows), and {where} "
                         f"{have / 2**30:,.1f} GiB: use a smaller --hidden, --layers, batch or --seq-len")


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE (its --nproc-per-node), else the whole world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def choose_backend(requested: str | None, world_size: int) -> str:
    """NCCL when every rank on this machine can have a GPU of its own (the default), gloo otherwise.

    NCCL runs one rank per GPU (course_lib.runtime.launch.device() is cuda:LOCAL_RANK), so asking for it with more
    local ranks than GPUs is refused here, with the two ways out."""
    ranks, gpus = local_ranks(world_size), torch.cuda.device_count()   # device_count is 0 without CUDA
    if requested is None:
        return "nccl" if gpus >= ranks else "gloo"
    if requested == "nccl" and gpus < ranks:
        fewer = "--nproc-per-node" if "LOCAL_WORLD_SIZE" in os.environ else "--world-size"
        where = " on this node" if fewer == "--nproc-per-node" else ""
        way_out = f"use {fewer} {gpus} or --backend gloo" if gpus else "use --backend gloo"
        raise ValueError(f"NCCL needs one GPU per rank: {ranks} rank{'s' * (ranks != 1)}{where}, "
                         f"{gpus} GPU{'s' * (gpus != 1)}; {way_out}")
    return requested


def autocast(dtype: str):
    """The context a rank computes in: torch.autocast to bfloat16 for ``dtype="bf16"`` (on the rank's device,
    GPU or CPU), nothing for "fp32". Weights, gradients and optimizer state stay float32 either way.

    Labs that own their loop put only forward and loss inside it, as torch advises; labs that call one of
    course_lib.runs' loops wrap the whole step (backward then runs each op in the dtype its forward op used,
    which is what autocast does anyway)."""
    return torch.autocast(device().type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def reset_peak_memory() -> None:
    """Start counting this rank's peak GPU memory afresh (nothing to count on a CPU), after freeing what an earlier
    run left in reference cycles (torch's fully_shard leaves its model to the garbage collector)."""
    if device().type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device())


def peak_memory() -> int | None:
    """torch.cuda.max_memory_allocated of this rank's GPU since the last reset, in bytes; None on a CPU, where
    the caching allocator does not exist (and RSS counts torch itself: useless here)."""
    return torch.cuda.max_memory_allocated(device()) if device().type == "cuda" else None


def cpu_model() -> str:
    """The CPU's name as the kernel reports it, e.g. "AMD EPYC 7B13"; the architecture where it does not."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(backend: str, world_size: int) -> str:
    """What the ranks ran on, for a reader of the results: "8 × NVIDIA H100 80GB HBM3" (with "2 nodes × "
    in front when the world spans nodes), or "AMD EPYC 7B13 (2 cores)"."""
    if backend != "nccl":
        return f"{cpu_model()} ({len(os.sched_getaffinity(0))} cores)"
    per_node = local_ranks(world_size)
    nodes = world_size // per_node
    return f"{f'{nodes} nodes × ' if nodes > 1 else ''}{per_node} × {torch.cuda.get_device_name(0)}"


def run_info(args) -> dict:
    """Where and how this run happened: the keys course_lib.presentation.lab_results reads to label it honestly; ``nodes``
    names each machine the ranks ran on (several in a multi-node run under torchrun)."""
    return {"world_size": args.world_size, "backend": args.backend, "device": "cuda" if args.backend == "nccl" else "cpu",
            "machine": machine(args.backend, args.world_size), "nodes": nodes(), "dtype": getattr(args, "dtype", None),
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def write_record(args, name: str, record: dict) -> Path:
    """Write ``record`` with run_info to ``args.out``/``name``.json (atomically) and return the path."""
    path = args.out / f"{name}.json"
    text = json.dumps({**record, **run_info(args)}, indent=1)
    write_atomically(path, lambda partial: partial.write_text(text))
    return path


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


def fp32_adam_state_bytes(num_params: int) -> int:
    """The ledger's training state of fp32 Adam, 4 + 4 + 8 = 16 bytes per parameter (ledger.CONVENTIONS)."""
    from course_lib.ledger import CONVENTIONS, zero_state_bytes

    return zero_state_bytes(num_params, 0, 1, **CONVENTIONS["fp32"].per_param)["total"]


def reports() -> bool:
    """Rank 0 prints the table and writes the files (under torchrun every process runs main)."""
    return int(os.environ.get("RANK", 0)) == 0
