"""Incidents that hang, or wait: ranks that disagree on which collective or send comes next, and a rank that is
slower than the others."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...comm import Comm
from ...data import shard
from ...model import loss_fn
from ...pipeline_parallel import make_stage, partition_layers
from ...runtime.files import write_atomically
from .common import BATCH_SIZE, LR, SEQ_LEN, STEPS, average_gradients, flat, sgd_step, tiny

RECORD_AFTER_S = 2.0       # uneven_shards' ranks are all waiting well before this: then each dumps its recorder


def checked_comm(debug: bool) -> Comm:
    """The world's Comm; with ``debug``, over a new group made under TORCH_DISTRIBUTED_DEBUG=DETAIL's level
    (dist.set_debug_level), whose every collective first compares its kind and shapes across the ranks: a
    mismatch is an error naming both ranks' collectives instead of a hang. The level is set back at once."""
    if not debug:
        return Comm()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return Comm(dist.new_group(list(range(dist.get_world_size()))))
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def steps_from_my_rows(dataset_rows: int, my_rows: int, world_size: int, batch_size: int) -> int:
    """The bug: the steps of an epoch counted from this rank's own rows, its short last batch dropped. A rank
    with a row more than the others can take a step more."""
    return my_rows // (batch_size // world_size)


def steps_from_the_dataset(dataset_rows: int, my_rows: int, world_size: int, batch_size: int) -> int:
    """The fix: the steps counted from the whole dataset, whole global batches of ``batch_size`` rows only (as
    DistributedSampler(drop_last=True) does): the same number on every rank."""
    return dataset_rows // batch_size


def dump_flight_recorder(path: Path, world_size: int) -> None:
    """This rank's flight recorder, pickled as torchfrtrace reads it, written to ``path``.

    The flight recorder is torch's ring buffer of the last collectives each process group of this process issued
    (kind, sizes, sequence number, Python stack), kept on every backend by default (TORCH_FR_BUFFER_SIZE sets its
    length). NCCL keeps its own recorder, which its watchdog dumps by itself on a timeout
    (TORCH_NCCL_DUMP_ON_TIMEOUT=1, into files named by TORCH_FR_DUMP_TEMP_FILE); gloo's has no watchdog. This dumps
    the recorder of the backend the world runs on, through torch._C's bindings (no public Python name). Gloo's
    dump leaves the table of process groups empty; the analyzer needs it to match the ranks' collectives, so it is
    filled in here for the groups the incidents use, which span the world."""
    from torch._C import _distributed_c10d

    if dist.is_initialized() and dist.get_backend() == "nccl":
        dump = pickle.loads(_distributed_c10d._dump_nccl_trace(includeCollectives=True, includeStackTraces=True,
                                                               onlyActive=False))
    else:
        dump = pickle.loads(_distributed_c10d._dump_fr_trace(True, True))   # with the collectives and their stacks
        groups = {tuple(entry["process_group"]) for entry in dump["entries"]}
        dump["pg_config"] = {name: {"name": name, "desc": desc, "ranks": str(list(range(world_size)))}
                             for name, desc in groups}
    write_atomically(Path(path), lambda partial: partial.write_bytes(pickle.dumps(dump)))


def analyze_flight_records(folder: str) -> str:
    """torch's flight recorder analyzer (``torchfrtrace <folder>``) on every rank's dump in ``folder``: it matches
    the ranks' collectives by sequence number and names the first that not every rank issued, with its stack.
    Returns what it printed."""
    analyzer = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)]
    done = subprocess.run(analyzer, capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def uneven_shards(rank: int, world_size: int, *, fixed: bool = False, debug: bool = False, steps_of=None,
                  flight_records: str | None = None) -> dict:
    """Data parallelism over a dataset of STEPS × BATCH_SIZE - 1 rows, each rank reading every world_size-th row
    (DistributedSampler's way) in batches of BATCH_SIZE / world_size, for ``steps_of(dataset_rows, my_rows,
    world_size, batch_size)`` steps (default: steps_from_my_rows, the bug, or steps_from_the_dataset if
    ``fixed``). Rank 0, with a row more, takes one step more than rank 1; its gradient all-reduce waits for a
    rank that has gone on to the barrier before saving. ``debug``: the collectives checked (checked_comm).
    ``flight_records``: a folder where each rank dumps its flight recorder (rank<r>) RECORD_AFTER_S seconds in,
    from a timer thread, while the main thread waits."""
    steps_of = steps_of or (steps_from_the_dataset if fixed else steps_from_my_rows)
    if flight_records is not None:
        dump = threading.Timer(RECORD_AFTER_S, dump_flight_recorder, [Path(flight_records) / f"rank{rank}", world_size])
        dump.daemon = True                  # a rank that finishes first is not kept alive by it
        dump.start()
    model, optimizer, data = tiny()
    inputs, targets = (torch.cat(parts) for parts in zip(*(data.batch(step, BATCH_SIZE) for step in range(STEPS))))
    rows = len(inputs) - 1                             # a dataset whose size is no multiple of the batch
    inputs, targets = inputs[:rows][rank::world_size], targets[:rows][rank::world_size]
    local = BATCH_SIZE // world_size
    num_steps = steps_of(rows, len(inputs), world_size, BATCH_SIZE)
    comm = checked_comm(debug)
    losses = []
    for step in range(num_steps):
        batch = slice(step * local, (step + 1) * local)
        losses.append(sgd_step(model, optimizer, inputs[batch], targets[batch],
                               lambda m: average_gradients(m, comm)))
    comm.barrier()                                     # every rank done before the checkpoint is written
    return {"steps": num_steps, "losses": losses, "weights": flat(model)}


def send_then_receive(comm: Comm, outgoing: torch.Tensor, incoming: torch.Tensor, peer: int) -> None:
    """The bug: a blocking send, then a blocking receive. Two ranks that both send first wait for each other."""
    comm.send(outgoing, peer)
    comm.recv(incoming, peer)


def posted_together(comm: Comm, outgoing: torch.Tensor, incoming: torch.Tensor, peer: int) -> None:
    """The fix: the send and the receive posted as one batch (torch's batch_isend_irecv), then both waited for."""
    for work in comm.exchange(sends=[(outgoing, peer)], recvs=[(incoming, peer)]):
        work.wait()


def pipeline_sends(rank: int, world_size: int, *, fixed: bool = False, num_microbatches: int = 2,
                   swap=None) -> dict:
    """Two pipeline stages, 1F1B over ``num_microbatches`` micro-batches, exchanging through ``swap(comm,
    outgoing, incoming, peer)`` wherever both stages have something to send (default: send_then_receive, or
    posted_together if ``fixed``).

    The bug: in 1F1B's steady state stage 0 sends micro-batch i+1's activations while stage 1 sends micro-batch
    i's gradient back; each send waits for its receive, and each rank posts its receive only after its send: both
    wait forever. The fix: post the pair together, as Megatron-LM's send_forward_recv_backward does. Returns each
    stage's weights by name."""
    if world_size != 2:
        raise ValueError(f"world_size={world_size}: this incident is a pipeline of 2 stages, one per rank")
    swap = swap or (posted_together if fixed else send_then_receive)
    model, _, data = tiny()
    stage = make_stage(model, rank, partition_layers(model.config.num_layers, 2))
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    comm, m = Comm(), num_microbatches
    shape = (BATCH_SIZE // m, SEQ_LEN, model.config.hidden)

    def exchanged(outgoing: torch.Tensor) -> torch.Tensor:
        incoming = torch.empty(shape, dtype=torch.float64)
        swap(comm, outgoing, incoming, 1 - rank)
        return incoming

    losses = []
    for step in range(STEPS):
        inputs, targets = (t.chunk(m) for t in data.batch(step, BATCH_SIZE))
        optimizer.zero_grad()
        if rank == 0:
            outputs = [stage(inputs[0])]
            comm.send(outputs[0].detach(), 1)
            for i in range(m):
                if i + 1 < m:                          # steady state: forward i+1, then swap with the gradient of i
                    outputs.append(stage(inputs[i + 1]))
                    grad = exchanged(outputs[i + 1].detach())
                else:
                    comm.recv(grad := torch.empty(shape, dtype=torch.float64), 1)
                outputs[i].backward(grad)
        else:
            comm.recv(hidden := torch.empty(shape, dtype=torch.float64), 0)
            total = 0.0
            for i in range(m):
                hidden.requires_grad_()
                loss = loss_fn(stage(hidden), targets[i]) / m
                loss.backward()
                total += loss.item()
                if i + 1 < m:
                    hidden = exchanged(hidden.grad)
                else:
                    comm.send(hidden.grad, 0)
            losses.append(total)
        optimizer.step()
    return {"losses": losses, "weights": {name: p.detach().clone() for name, p in stage.named_parameters()}}


def straggler(rank: int, world_size: int, *, fixed: bool = False, slow_rank: int = 1, delay_s: float = 0.2) -> dict:
    """Data parallelism where rank ``slow_rank`` takes ``delay_s`` longer for each forward (a throttled GPU, a
    busy host, a slow data loader). Nothing fails: every rank's step takes as long as the slowest, and the others
    spend the difference waiting inside the gradient all-reduce, so the straggler is the rank that waits least.
    "The fix" is a machine without it (fixed=True). Returns each step's seconds and its seconds in the all-reduce."""
    model, optimizer, data = tiny()
    comm = Comm()
    step_s, wait_s = [], []

    def timed_average(m):
        start = time.perf_counter()
        average_gradients(m, comm)
        wait_s.append(time.perf_counter() - start)

    comm.barrier()
    for step in range(STEPS):
        start = time.perf_counter()
        if rank == slow_rank and not fixed:
            time.sleep(delay_s)
        inputs, targets = (shard(t, rank, world_size) for t in data.batch(step, BATCH_SIZE))
        sgd_step(model, optimizer, inputs, targets, timed_average)
        step_s.append(time.perf_counter() - start)
    return {"step_s": step_s, "wait_s": wait_s, "weights": flat(model)}
