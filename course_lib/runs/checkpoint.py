"""Checkpoint runs (notebook 10, lab checkpoint, tests, benchmark): train the course model in one layout, save,
stop (or be killed), and go on in another layout from the checkpoint.

A layout is a dict: {"dp", "tp", "pp", "zero_stage"}, e.g. LAYOUTS["dp2 tp2 pp2 zero1"]. Every layout trains the
same way: each dp rank takes its rows of the step's batch (data.shard), the pipeline runs them in micro-batches
inside ``no_sync()``, ZeroDataParallel averages the gradients over dp (the stage's way) and Adam steps its shards.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import warnings

import torch
import torch.distributed as dist

from .. import checkpoint
from ..clip import clip_zero_
from ..data import SyntheticTokens, shard
from ..job import Job
from ..mesh import Mesh, make_comms
from ..model import build, preset
from ..parallelize import parallelize
from ..pipeline_parallel import pipeline_step
from ..runtime.launch import device

LAYOUTS = {
    "dp2 tp2 pp2 zero1": dict(dp=2, tp=2, pp=2, zero_stage=1),
    "dp2 tp2 zero3": dict(dp=2, tp=2, pp=1, zero_stage=3),
    "dp4 zero3": dict(dp=4, tp=1, pp=1, zero_stage=3),
    "tp4 dp2 zero1": dict(dp=2, tp=4, pp=1, zero_stage=1),
    "pp4": dict(dp=1, tp=1, pp=4, zero_stage=0),
    "dp2 tp2 ddp": dict(dp=2, tp=2, pp=1, zero_stage=0),
    "dp2 zero1": dict(dp=2, tp=1, pp=1, zero_stage=1),
    "pp2": dict(dp=1, tp=1, pp=2, zero_stage=0),
    "one process": dict(dp=1, tp=1, pp=1, zero_stage=0),
}
DEFAULTS = dict(batch_size=8, seq_len=16, lr=1e-2, seed=0, num_microbatches=2)


def layout_name(layout: dict) -> str:
    return f"dp {layout['dp']} × tp {layout['tp']} × pp {layout['pp']}, ZeRO-{layout['zero_stage']}"


def world_of(layout: dict) -> int:
    return layout["dp"] * layout["tp"] * layout["pp"]


class Trainer:
    """The course model on this rank, cut for ``layout``, with its data stream; ``step(k)`` runs training step k."""

    def __init__(self, rank: int, world_size: int, layout: dict, *, dtype=torch.float64, batch_size: int = 8,
                 seq_len: int = 16, lr: float = 1e-2, seed: int = 0, num_microbatches: int = 2, config=None,
                 max_norm: float | None = None, slow_rank: int | None = None, delay_s: float = 0.0):
        warnings.filterwarnings("ignore", category=FutureWarning)   # gloo's reduce_scatter/all_gather notices
        self.rank, self.layout = rank, layout
        self.mesh = Mesh(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"])
        self.mesh.check(world_size)
        self.config = config or preset("tiny")
        m = num_microbatches if layout["pp"] > 1 else 1
        self.mesh.check_model(self.config, batch_size=batch_size, num_microbatches=m)
        self.comms = make_comms(self.mesh, rank)
        model = build(self.config, seed=seed, device=device(), dtype=dtype)
        adam = dict(optimizer_class=functools.partial(torch.optim.Adam, foreach=False), lr=lr)
        job = Job(self.config, self.mesh, seq_len=seq_len, micro_batch_size=batch_size // (self.mesh.dp * m),
                  num_microbatches=m, zero_stage=layout["zero_stage"])
        self.parallel = parallelize(model, job, self.comms, rank, optimizer_kwargs=adam)
        self.dp = self.parallel.data_parallel          # a ZeroDataParallel: its shards are what a checkpoint holds
        self.data = SyntheticTokens(self.config.vocab_size, seq_len, seed=seed)
        self.seed, self.batch_size, self.num_microbatches, self.next_step = seed, batch_size, m, 0
        self.step_seconds: list[float] = []
        self.comm_seconds: list[float] = []          # per step: time inside traced collectives (mostly waiting)
        self.delay_s = delay_s if rank == slow_rank else 0.0   # a straggler: this rank computes delay_s longer
        self.max_norm, self.norms = max_norm, []     # clip by the global gradient norm (course_lib.clip)

    def step(self, kill_after_backward: bool = False) -> float | None:
        """One training step (the next one); returns the loss on the last stage, else None. ``kill_after_backward``:
        this process SIGKILLs itself in the middle of the step, between backward and the gradients' average (for the failure demos)."""
        start = time.perf_counter()
        where = self.mesh.coords(self.rank)
        inputs, targets = (shard(t, where["dp"], self.mesh.dp) for t in self.data.batch(self.next_step, self.batch_size))
        with contextlib.ExitStack() as traces:
            logs = [traces.enter_context(self.comms[axis].trace()) for axis in ("tp", "pp", "dp")]
            with self.dp.no_sync():   # Parallelized.forward_backward's two halves, to die or dawdle in between
                result = pipeline_step(self.parallel.stage, self.comms["pp"], inputs, targets,
                                       num_microbatches=self.num_microbatches)
            if kill_after_backward:   # gradients computed, not yet averaged: the peers wait for this rank in vain
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.delay_s)
            self.dp.finish_gradient_sync()
            if self.max_norm is not None:
                self.norms.append(clip_zero_(self.dp, self.mesh, self.rank, self.max_norm).item())
            self.dp.step()
        self.comm_seconds.append(sum(r.seconds for log in logs for r in log.records))
        self.next_step += 1
        self.step_seconds.append(time.perf_counter() - start)
        return result["loss"]

    def train_state(self) -> dict:
        return checkpoint.train_state(self.next_step, seed=self.seed, batch_size=self.batch_size, config=self.config)

    def save(self, path: str, asynchronous: bool = False):
        return checkpoint.save(self.dp, self.mesh, self.rank, path, self.train_state(), asynchronous=asynchronous)

    def load(self, path: str) -> dict:
        def same_data(saved: dict) -> None:
            if (saved["data"]["seed"], saved["data"]["batch_size"]) != (self.seed, self.batch_size):
                raise ValueError(f"the checkpoint's data stream (seed {saved['data']['seed']}, batch "
                                 f"{saved['data']['batch_size']}) is not this run's (seed {self.seed}, batch "
                                 f"{self.batch_size}): resuming would train on other data")
        train = checkpoint.load(self.dp, self.mesh, self.rank, path, self.train_state(), check=same_data)
        self.next_step = train["data"]["next_step"]
        return train

    def pieces(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name (TP pieces; stage 3 gathers each unit's weights for the copy), copied to
        the CPU: they leave the rank, and are compared with one process's weights on the CPU."""
        if self.dp.zero_stage == 3:
            for unit in self.dp.units:
                unit.gather(unit.shard, self.dp.comm)
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.dp.module.named_parameters()}
        if self.dp.zero_stage == 3:
            for unit in self.dp.units:
                unit.free()
        return out


def save_and_resume(rank: int, world_size: int, *, layout: dict, steps: int, root: str, save_at: int | None = None,
                    resume_from: str | None = None, final: str | None = None, **kwargs) -> dict:
    """For ``launch``: a Trainer in ``layout`` (``kwargs``: Trainer's); load ``resume_from`` if given; train until ``steps`` steps are done
    in all, saving to ``root``/step_K after step K = ``save_at``; save the end to ``final`` if given. Returns this
    rank's coordinates, parameters by name, losses, step seconds and (with max_norm) global gradient norms."""
    trainer = Trainer(rank, world_size, layout, **kwargs)
    if resume_from:
        trainer.load(resume_from)
    losses = []
    while trainer.next_step < steps:
        losses.append(trainer.step())
        if trainer.next_step == save_at:
            trainer.save(os.path.join(root, f"step_{save_at}"))
    if final:
        trainer.save(final)
    return {"rank": rank, "coords": trainer.mesh.coords(rank), "params": trainer.pieces(), "losses": losses,
            "step_seconds": trainer.step_seconds, "comm_seconds": trainer.comm_seconds, "norms": trainer.norms}


def run_with_failure(rank: int, world_size: int, *, layout: dict, steps: int, root: str, every: int,
                     kill_at: int | None = None, kill_rank: int = 1, **kwargs) -> dict:
    """For ``launch`` or torchrun: train to ``steps``, saving a checkpoint to ``root`` every ``every`` steps; start
    from the latest complete checkpoint there, if any. ``kill_at``: rank ``kill_rank`` kills itself in the middle
    of that step (the caller arranges that only the first attempt does). Returns where it started, its losses."""
    trainer = Trainer(rank, world_size, layout, **kwargs)
    latest = checkpoint.latest(root)
    if latest:
        trainer.load(latest)
    started, losses = trainer.next_step, []
    while trainer.next_step < steps:
        losses.append(trainer.step(kill_after_backward=trainer.next_step == kill_at and rank == kill_rank))
        if trainer.next_step % every == 0 or trainer.next_step == steps:
            trainer.save(os.path.join(root, f"step_{trainer.next_step:05d}"))
    return {"rank": rank, "started_at": started, "resumed_from": latest, "losses": losses,
            "params": trainer.pieces(), "coords": trainer.mesh.coords(rank)}


def async_overlap(rank: int, world_size: int, *, layout: dict, root: str, steps: int = 4, **kwargs) -> dict:
    """Seconds per step, per rank: plain steps, steps that first save (dcp.save, blocking) and steps that first
    start a dcp.async_save (it stages a copy, then writes in a thread while the step computes; waited for before
    the next save). Returns the three lists and the blocking part of each async save."""
    trainer = Trainer(rank, world_size, layout, **kwargs)
    timings = {"plain": [], "save": [], "async_save": [], "async_blocking": []}
    trainer.step()                                                      # warm-up
    pending = None
    for kind in ("plain", "save", "async_save"):
        for k in range(steps):
            dist.barrier()               # the default group: the saves' own collectives run on groups of their own
            start = time.perf_counter()
            path = os.path.join(root, f"{kind}_{k}")
            if kind == "save":
                trainer.save(path)
            elif kind == "async_save":
                pending = trainer.save(path, asynchronous=True)   # waits for the last one first
                timings["async_blocking"].append(time.perf_counter() - start)
            trainer.step()
            timings[kind].append(time.perf_counter() - start)
    pending.result()
    return timings
