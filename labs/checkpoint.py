"""Lab 10: save, kill, resume, reshard: a run that loses a rank ends with the weights of a run that never did.

    python labs/checkpoint.py --world-size 8 --out /tmp/ckpt                          # this CPU: 8 gloo ranks
    torchrun --standalone --nproc-per-node 8 --max-restarts 1 labs/checkpoint.py --out /tmp/ckpt   # one GPU box

(It knows layouts for 1, 2, 4 and 8 ranks: one box, not two.)

The course model trains in float64 (the lab checks to 1e-12, not to a dtype's luck) in a layout of the world
(8 ranks: dp 2 × tp 2 × pp 2 with ZeRO-1), saving a distributed checkpoint (course_lib.checkpoint, DCP) every
--every steps under --out/checkpoints. In the middle of step --kill-at, rank --kill-rank SIGKILLs itself. Under
torchrun --max-restarts, torchrun sees the dead rank, stops the others and starts every rank again
(TORCHELASTIC_RESTART_COUNT = 1: this attempt kills nobody); without torchrun the lab catches the RankError and
launches again, as the notebook does. Either way the new ranks resume from the newest complete checkpoint and
finish. Then the checkpoint taken before the kill is loaded into another layout of the same world (resharding)
and trained to the end too. Checked: both runs end within 1e-12 of one process trained without a break; the work
lost is the steps since that checkpoint. Writes --out/checkpoint.json (the lab's record; default labs/results).

What it deletes: only its own step_NNNNN folders under --out/checkpoints, at the start of a run, in a folder it
made (it leaves a marker file there, .made-by-labs-checkpoint). Anything else in that folder stays; a non-empty
--out/checkpoints it did not make is refused, unless --force (then too only its step_NNNNN folders go).
"""

import atexit
import datetime
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import lab_parser, model_overrides, parse, reports, write_record
from course_lib import launch
from course_lib.checkpoint_commit import PARTIAL, REPLACED
from course_lib.model import preset
from course_lib.runs.checkpoint import DEFAULTS, LAYOUTS, layout_name, run_with_failure, save_and_resume
from course_lib.runs.mesh import max_parameter_gap
from course_lib.runtime.arguments import integer
from course_lib.runtime.launch import RankError
from course_lib.runtime.launch import _leave_cleanly as leave_cleanly  # launch's exit under torchrun
from course_lib.train import reference_run

LAYOUT_FOR = {8: ("dp2 tp2 pp2 zero1", "tp4 dp2 zero1"), 4: ("dp2 tp2 zero3", "pp4"), 2: ("dp2 zero1", "pp2"),
              1: ("one process", "one process")}
TOLERANCE = 1e-12


def join_this_attempt(backend: str, world_size: int) -> None:
    """Under torchrun --max-restarts: join the process group through this attempt's own keys in torchrun's store.

    A restarted rank otherwise reads the address a rank of the failed attempt left in the store (torchrun keeps
    the store across restarts; pytorch/pytorch#167288), and gloo's connectFullMesh fails with "Connection
    refused" (seen here with 4 ranks, torch 2.13). A PrefixStore per TORCHELASTIC_RESTART_COUNT keeps attempts
    apart. ``launch`` then runs on this group, as on any group torchrun made."""
    gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else None   # as launch binds it
    if gpu is not None:
        torch.cuda.set_device(gpu)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size, device_id=gpu)
    atexit.register(leave_cleanly)       # as launch does for the groups it makes under torchrun


MARKER = ".made-by-labs-checkpoint"


def claim_checkpoint_folder(root: Path, force: bool) -> str | None:
    """Make ``root`` this lab's (create it with its marker), or say why not: a non-empty folder the lab did not
    make is someone else's, unless ``force``. Returns the refusal, or None."""
    if root.exists() and not root.is_dir():
        return f"--out: {root} is a file, not a folder for checkpoints"
    if root.is_dir() and any(root.iterdir()) and not (root / MARKER).exists() and not force:
        return (f"--out: {root} is not empty and this lab did not make it; it deletes its own step_NNNNN folders "
                "there: choose another --out, or pass --force")
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).touch()
    return None


def remove_old_steps(root: str) -> None:
    """The step_NNNNN folders a previous run of the lab saved (course_lib.runs.checkpoint names them so), with
    their .partial and .replaced forms (a commit cut between its renames: checkpoint.latest would resume from
    it), and nothing else."""
    for entry in Path(root).glob("step_*"):
        step = entry.name[len("step_"):].removesuffix(PARTIAL).removesuffix(REPLACED)
        if entry.is_dir() and step.isdigit():
            shutil.rmtree(entry)


def attempt(rank, world_size, *, first: bool, root: str, **kwargs):
    """One attempt of the job on every rank: the first starts from nothing (rank 0 removes the lab's old
    checkpoints) and has a rank killed; a later one resumes from the newest checkpoint."""
    if first and rank == 0:
        remove_old_steps(root)
    dist.barrier()
    if not first:
        kwargs["kill_at"] = None
    return run_with_failure(rank, world_size, root=root, **kwargs)


def main(argv=None):
    parser = lab_parser(__doc__, world_size=8, steps=8, lr=1e-2, autocast=False)
    parser.add_argument("--every", type=integer(1), default=3, help="steps between checkpoints")
    parser.add_argument("--kill-at", type=integer(0), default=5, help="the step in which a rank dies")
    parser.add_argument("--kill-rank", type=integer(0), default=1)
    parser.add_argument("--global-batch-size", type=integer(1), default=8)
    parser.add_argument("--no-kill", action="store_true",
                        help="kill nobody (torchrun without --max-restarts, as make gpu-check runs it): save, resume "
                             "in another layout, compare")
    parser.add_argument("--force", action="store_true",
                        help="use --out/checkpoints though this lab did not make it (only its step_NNNNN folders "
                             "are deleted)")
    parser.set_defaults(seq_len=16, dtype="fp64")
    args = parse(parser, argv)
    if args.world_size not in LAYOUT_FOR:
        parser.error(f"--world-size {args.world_size}: this lab has layouts for {sorted(LAYOUT_FOR)} ranks")
    for name in LAYOUT_FOR[args.world_size]:   # each layout's dp shares, in its pipeline's micro-batches
        layout = LAYOUTS[name]
        split = layout["dp"] * (DEFAULTS["num_microbatches"] if layout["pp"] > 1 else 1)
        if args.global_batch_size % split:
            parser.error(f"--global-batch-size {args.global_batch_size} does not split over {name}: it needs a "
                         f"multiple of {split} (dp {layout['dp']}" + (f" × {DEFAULTS['num_microbatches']} "
                         "micro-batches)" if layout["pp"] > 1 else ")"))
    # --kill-at also names the checkpoint a --no-kill run resumes from; --kill-rank matters only with a kill
    if not args.every <= args.kill_at < args.steps or not (args.no_kill or 0 <= args.kill_rank < args.world_size):
        parser.error(f"--kill-at {args.kill_at} must be a step inside {args.every}..{args.steps - 1} (after the first "
                     f"checkpoint, --every {args.every}) and --kill-rank {args.kill_rank} a rank of the {args.world_size}")
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0" and not args.no_kill:
        parser.error("a rank is killed on purpose: run under torchrun --max-restarts 1 (or pass --no-kill)")
    refusal = claim_checkpoint_folder(args.out / "checkpoints", args.force)
    if refusal:
        parser.error(refusal)
    source, target = (LAYOUTS[name] for name in LAYOUT_FOR[args.world_size])
    root = str(args.out / "checkpoints")
    config = preset("tiny", **model_overrides(args))
    common = dict(steps=args.steps, batch_size=args.global_batch_size, seq_len=args.seq_len, lr=args.lr, config=config)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    job = dict(layout=source, every=args.every, kill_at=None if args.no_kill else args.kill_at,
               kill_rank=args.kill_rank, **common)
    start = time.perf_counter()
    if args.no_kill:
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            join_this_attempt(args.backend, args.world_size)
        finished = launch(attempt, args.world_size, backend=args.backend, timeout=args.timeout, first=True, root=root, **job)
        finished[0]["resumed_from"] = os.path.join(root, f"step_{args.kill_at // args.every * args.every:05d}")
        finished[0]["started_at"] = args.kill_at      # nothing was lost: no rank died
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:   # torchrun: a dead rank ends this process; torchrun restarts us
        join_this_attempt(args.backend, args.world_size)
        finished = launch(attempt, args.world_size, backend=args.backend, timeout=args.timeout, first=restarts == 0, root=root, **job)
    else:                                             # here: catch the dead rank ourselves, and launch again
        try:
            launch(attempt, args.world_size, backend=args.backend, timeout=args.timeout, first=True, root=root, **job)
            raise AssertionError(f"rank {args.kill_rank} was to die in step {args.kill_at}, but the run finished")
        except RankError as error:
            if error.rank != args.kill_rank or "SIGKILL" not in error.summary:   # not our kill: a real failure
                raise
            print(f"attempt 1 failed as planned: {str(error).splitlines()[0]}")
        restarts = 1
        finished = launch(attempt, args.world_size, backend=args.backend, timeout=args.timeout, first=False, root=root, **job)
    resumed_from = finished[0]["resumed_from"]
    resharded = launch(save_and_resume, args.world_size, backend=args.backend, timeout=args.timeout, layout=target, root="",
                       resume_from=resumed_from, **{k: v for k, v in common.items() if k != "steps"},
                       steps=args.steps)
    if not reports():
        return None
    reference = reference_run(config, steps=args.steps, batch_size=args.global_batch_size, lr=args.lr, seq_len=args.seq_len,
                              dtype=torch.float64)[1].state_dict()
    gap, reshard_gap = max_parameter_gap(finished, reference), max_parameter_gap(resharded, reference)
    started = finished[0]["started_at"]
    record = {"layout": layout_name(source), "resharded_into": layout_name(target), "steps": args.steps,
              "every": args.every, "kill_at": args.kill_at, "kill_rank": args.kill_rank, "restarts": restarts,
              "resumed_from": os.path.basename(resumed_from), "started_at": started,
              "lost_steps": args.kill_at - started, "max_gap_vs_one_process": gap,
              "resharded_max_gap_vs_one_process": reshard_gap, "seconds": time.perf_counter() - start}
    record["killed"] = not args.no_kill
    story = (f"saved every {args.every} steps, nobody killed (--no-kill)" if args.no_kill else
             f"rank {args.kill_rank} killed in step {args.kill_at}; {restarts} restart; resumed from "
             f"{record['resumed_from']} (steps {started}..{args.kill_at - 1} done again, plus the killed step's partial "
             "work)")
    print(f"\n{layout_name(source)}: {story}\n"
          f"max |w - one process| after {args.steps} steps: {gap:.1e}; resumed in {layout_name(target)}: "
          f"{reshard_gap:.1e} (tolerance {TOLERANCE:g})")
    assert gap < TOLERANCE and reshard_gap < TOLERANCE, (gap, reshard_gap)
    path = write_record(args, "checkpoint", record)
    step_timeline(record).savefig(args.out / "checkpoint.png", dpi=100)
    print(f"wrote {path} and .png")
    return record


def step_timeline(record: dict):
    """Each step as a bar: done once, or done again after the restart; the checkpoints and the kill marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 2.2))
    again = range(record["started_at"], record["kill_at"]) if record["killed"] else range(0)
    for step in range(record["steps"]):
        axes.barh(0, 0.9, left=step, color="tab:orange" if step in again else "tab:green")
    for step in range(record["every"], record["steps"], record["every"]):
        axes.axvline(step - 0.05, color="black", linestyle="--", linewidth=1)
    if record["killed"]:
        axes.plot(record["kill_at"] + 0.45, 0, "rx", markersize=14, markeredgewidth=3)
    axes.set_yticks([])
    axes.set_xlabel("step (green: run once; orange: run again after the restart; dashed: checkpoint; x: rank killed)")
    axes.set_title(f"{record['layout']}: {len(again)} step(s) lost, resumed from {record['resumed_from']}")
    figure.tight_layout()
    return figure


if __name__ == "__main__":
    main()
