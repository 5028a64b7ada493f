"""Distributed checkpoints (分布式检查点) of the course's sharded training state, with torch.distributed.checkpoint.

A checkpoint is the whole training state: weights, optimizer state (Adam's two moments), the step, where the data
stream stands, the random generator. Gathered onto one rank it would be an 828 GB file for a 70B run (12 bytes
a parameter), written by one GPU while the others wait; and a file that only the layout that wrote it can read
is a liability: after a failure the job often comes back on fewer nodes, or in another layout. DCP
(torch.distributed.checkpoint) solves both.

What DCP writes. Every tensor of the state dict is a *global* tensor (the whole weight, as one process would hold
it) known by its name; each rank writes the boxes of it that it holds (a box: offsets and sizes in the global
tensor, DCP's ChunkStorageMetadata) into its own file, and rank 0 writes a metadata file listing every box of
every tensor and where it lies. Loading is the same question asked again: which boxes does this rank hold *now*?
DCP reads the overlap of each wanted box with each saved one. So a checkpoint saved on dp 2 × tp 2 × pp 2 loads
into tp 4 × dp 2, into pp 4, or into one process without a gathered copy anywhere: resharding (重新切分).

How the course's shards become boxes (what is saved is its ZeRO and TP state itself, no gathered copy):

* TP (tensor_parallel.py): a ColumnParallelLinear holds rows [t·out/tp, (t+1)·out/tp) of the global weight, a
  RowParallelLinear columns [t·in/tp, ...): a box of the local tensor is the same box shifted by that offset.
* ZeRO (zero.py): a unit's parameters are concatenated into one flat buffer of dp·S elements (zero-padded) and
  rank r owns elements [r·S, (r+1)·S). A flat range of a parameter of shape [R, C] is at most three boxes: the
  tail of a row, whole rows, the head of a row (flat_range_boxes); the padding belongs to no parameter and is not
  saved. The Adam moments of the shard are flat the same way: the same boxes, under their own names.
* Who writes. Every element exactly once, or DCP's check (no overlapping boxes, the boxes fill the tensor) fails:
  a weight replicated over TP (norms, embedding, head) is written by tp rank 0; ZeRO-0 (plain DDP) by dp rank 0;
  ZeRO-1/2/3 by the rank that owns the shard (in ZeRO-1 the other dp ranks hold the same weights: not written).

DCP's extension point for this is the protocol DTensor implements: a value with ``__create_write_items__`` (the
boxes to write), ``__create_chunk_list__`` (the boxes to load) and ``__get_tensor_shard__`` (the tensor of one
box). ``ShardPieces`` is such a value for one global tensor, its boxes views into the rank's flat shard, so loading
writes straight into the shard. DCP's default planners look a box's tensor up only in torch.Tensor values; the two
planners here add that one lookup. (torchtitan instead makes every parameter a DTensor, Shard placements on a
DeviceMesh, and hands DCP the model's and the optimizer's state dicts; FSDP2's flat shards are Shard(0) of each
parameter, not of a unit's concatenation, so they need no splitting into boxes.)

Names, as torch's get_state_dict flattens them: ``model.<param>``, ``optimizer.state.<param>.exp_avg`` and
``.exp_avg_sq``, and ``train`` (the step, the data position, torch's RNG state). Adam's step counter, one per
parameter in torch, equals the training step for all of them: it is saved once, in ``train``.

A save is never seen half done, and a checkpoint never loads into another model or from a flipped byte:
course_lib/checkpoint_commit.py.

Bytes per rank (float64 Adam: 8 bytes of weight + 16 of moments per parameter): 24 × the parameters the rank
writes; over the ranks of one (stage, tp) place, 24 × (its parameters − the TP-replicated ones on tp ranks other
than 0), per_rank.checkpoint_bytes: the ledger's weights + optimizer state, divided over dp, each parameter once.
The whole checkpoint is 24·P in every layout. (Each box is one torch.save record in the rank's file, a few hundred
bytes of overhead each.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .checkpoint_commit import (
    MARKER,
    PARTIAL,
    REPLACED,
    PendingSave,
    check_ours,
    check_same_model,
    commit,
    committed,
    config_text,
    verify_checksums,
)
from .runtime import unfinished
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

MOMENTS = ("exp_avg", "exp_avg_sq")


def flat_range_boxes(start: int, stop: int, shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, stop) of a row-major tensor of ``shape`` (1-D or 2-D) as boxes (offsets, sizes): the tail
    of a row, whole rows, the head of a row (empty ones left out), in flat order."""
    if not 0 <= start <= stop <= torch.Size(shape).numel():
        raise ValueError(f"[{start}, {stop}) is not a range of the {torch.Size(shape).numel()} elements of {tuple(shape)}")
    if len(shape) == 1:
        return [((start,), (stop - start,))] if stop > start else []
    if len(shape) != 2:
        raise ValueError(f"shape {tuple(shape)}: the course model's parameters are 1-D or 2-D")
    columns, boxes = shape[1], []
    row, col = divmod(start, columns)
    if col and start < stop:                               # the tail of a partly covered first row
        width = min(columns - col, stop - start)
        boxes.append(((row, col), (1, width)))
        start, row = start + width, row + 1
    whole = (stop - start) // columns
    if whole:
        boxes.append(((row, 0), (whole, columns)))
        start, row = start + whole * columns, row + whole
    if stop > start:                                       # the head of a last, partly covered row
        boxes.append(((row, 0), (1, stop - start)))
    return boxes


def tp_placement(module: torch.nn.Module) -> dict[str, tuple[torch.Size, tuple[int, ...], bool]]:
    """For each parameter name: (its global shape, the offset of this rank's piece in it, whether TP splits it).
    Column layers split weight (and bias) along dim 0, row layers the weight along dim 1; the rest is whole."""
    placed = {}
    for prefix, sub in module.named_modules():
        if not isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            continue
        tp, t = sub.comm.size, sub.comm.rank
        for name, param in sub.named_parameters(recurse=False):
            dim = 0 if isinstance(sub, ColumnParallelLinear) else (1 if name == "weight" else None)
            if dim is None:                                # a row layer's bias is whole on every rank
                continue
            shape, offset = list(param.shape), [0] * param.dim()
            shape[dim], offset[dim] = shape[dim] * tp, t * param.shape[dim]
            placed[f"{prefix}.{name}"] = (torch.Size(shape), tuple(offset), True)
    return {name: placed.get(name, (param.shape, (0,) * param.dim(), False))
            for name, param in module.named_parameters()}


class ShardPieces:
    """One global tensor as DCP sees this rank's part of it: boxes (global offsets, sizes), each a view of
    ``flat`` (the rank's flat shard) from element ``start``. ``writes``: whether this rank saves them (every
    element is saved by one rank); every rank loads its boxes."""

    def __init__(self, flat: torch.Tensor, global_shape, boxes: list[tuple[tuple, tuple, int]], writes: bool):
        self.flat, self.global_shape, self.boxes, self.writes = flat, torch.Size(global_shape), boxes, writes

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self.boxes]

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.flat.dtype)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.global_shape))
                for chunk in self.__create_chunk_list__()] if self.writes else []

    def views(self) -> dict[tuple[int, ...], torch.Tensor]:
        """Each box's tensor, by its global offsets: a view of ``flat``."""
        return {tuple(offsets): self.flat[start:start + torch.Size(sizes).numel()].view(sizes)
                for offsets, sizes, start in self.boxes}

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        view = self.views().get(tuple(index.offset))
        if view is None:
            raise ValueError(f"{index.fqn}: this rank holds no box at offsets {tuple(index.offset)}")
        return view


def _lookup(state_dict: dict, index: MetadataIndex):
    value = state_dict[index.fqn]
    return value.__get_tensor_shard__(index) if isinstance(value, ShardPieces) else None


class CourseSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that also finds a box's tensor in a ShardPieces (dedup of the small replicated values,
    ``train``, on rank 0)."""

    def __init__(self):
        super().__init__(dedup_save_to_lowest_rank=True)

    def lookup_object(self, index):
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class CourseLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that also finds a box's tensor in a ShardPieces: DCP copies what it read into the view,
    that is, into the rank's shard. Its set_up_planner skips the default one's first walk over the state dict,
    which makes meta tensors real and, in torch 2.13, replaces any value it does not know (a ShardPieces) by None
    (planner_helpers._iterate_state_dict); the course never loads into meta tensors."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found


# ------------------------------------------------------------------------------ the course's state, as boxes

def shard_pieces(data_parallel, mesh, rank: int, flats: dict[str, list[torch.Tensor]]) -> dict[str, dict]:
    """{kind: {name: ShardPieces}} for the parameters of ``data_parallel`` (a zero.ZeroDataParallel over the dp
    group, any stage, wrapping this rank's TP/PP piece): ``flats[kind][u]`` is unit u's flat shard tensor of that
    kind (weights, an Adam moment, the gradient: all flat alike). A parameter the shard holds none of is left out."""
    coords, stage = mesh.coords(rank), data_parallel.zero_stage
    placement = tp_placement(data_parallel.module)
    pieces = {kind: {} for kind in flats}
    for u, unit in enumerate(data_parallel.units):
        first = 0 if stage == 0 else data_parallel.comm.rank * unit.shard_numel   # the unit's elements held here
        last = first + unit.shard.numel()
        owns = stage > 0 or coords["dp"] == 0
        names = [f"{unit.name}.{n}" for n, _ in unit.module.named_parameters()]
        for name, param, offset in zip(names, unit.params, unit.offsets):
            lo, hi = max(first, offset), min(last, offset + param.numel())
            if lo >= hi:
                continue
            global_shape, origin, split = placement[name]
            boxes = [(tuple(o + g for o, g in zip(box_offsets, origin)), sizes, start)
                     for box_offsets, sizes, start in _boxes_with_starts(lo - offset, hi - offset, param.shape,
                                                                        lo - first)]
            writes = owns and (split or coords["tp"] == 0)
            for kind, flat in flats.items():
                pieces[kind][name] = ShardPieces(flat[u], global_shape, boxes, writes)
    return pieces


def _boxes_with_starts(start: int, stop: int, shape, shard_start: int):
    """flat_range_boxes of [start, stop), each with where its elements begin in the shard."""
    at = shard_start
    for offsets, sizes in flat_range_boxes(start, stop, shape):
        yield offsets, sizes, at
        at += torch.Size(sizes).numel()


def init_optimizer_state(optimizer: torch.optim.Optimizer, tensors) -> None:
    """Give each of ``tensors`` the state torch's Adam makes at its first step (step 0, zero moments), so that a
    load has tensors to write into before any step has run."""
    for tensor in tensors:
        state = optimizer.state[tensor]
        if not state:
            state.update(step=torch.tensor(0.0), **{moment: torch.zeros_like(tensor) for moment in MOMENTS})


def resume_counters(optimizer: torch.optim.Optimizer, tensors, train: dict) -> None:
    """After a load: Adam's step counter of each of ``tensors`` and torch's RNG state, from the saved ``train``."""
    for tensor in tensors:
        optimizer.state[tensor]["step"].fill_(train["step"])
    torch.set_rng_state(train["rng"])


def course_state(data_parallel, mesh, rank: int, train: dict) -> dict:
    """The state dict to save or load: this rank's boxes of every weight and moment, and ``train`` (step, data
    position, RNG; a dict that loading fills in)."""
    init_optimizer_state(data_parallel.optimizer, [unit.shard for unit in data_parallel.units])
    state = data_parallel.optimizer.state
    flats = {"model": [unit.shard.detach() for unit in data_parallel.units],
             **{m: [state[unit.shard][m] for unit in data_parallel.units] for m in MOMENTS}}
    pieces = shard_pieces(data_parallel, mesh, rank, flats)
    moments = {name: {m: pieces[m][name] for m in MOMENTS} for name in pieces["model"]}
    return {"model": pieces["model"], "optimizer": {"state": moments}, "train": train}


def train_state(step: int, *, seed: int, batch_size: int, config=None) -> dict:
    """What is saved besides the tensors: the next step to run (the data stream is indexed by step, so that is
    where the data stands), the stream's seed and batch, torch's RNG state (the same on every rank here: every
    rank seeds alike; a model with dropout would draw from it), and the model's config, which load compares
    before it reads a weight (``config``: a ModelConfig, or None to check nothing)."""
    return {"step": step, "data": {"seed": seed, "next_step": step, "batch_size": batch_size},
            "rng": torch.get_rng_state(), "config": config_text(config)}


def _read_train(path: str, train: dict, **load_kwargs) -> dict:
    """The checkpoint's ``train`` entries alone (a few bytes: no weight is read), to check before loading."""
    probe = {"train": {**train}}
    with one_line_errors(path, "reading the step and config"):
        dcp.load(probe, checkpoint_id=path, planner=DefaultLoadPlanner(), **load_kwargs)
    return probe["train"]


@contextlib.contextmanager
def one_line_errors(path: str, action: str):
    """DCP reports a failure as a CheckpointException holding every rank's traceback (~70 lines, the cause on the
    last: a missing file, EOFError, "unexpected pos 704 vs 598" on a full disk): one line instead, naming the
    checkpoint, the rank and the cause."""
    try:
        yield
    except CheckpointException as error:
        rank, (cause, _) = next(iter(error.failures.items()))
        raise RuntimeError(f"{path}: {action} failed on rank {rank}: {type(cause).__name__}: {cause}") from None


def save(data_parallel, mesh, rank: int, path: str, train: dict, *, asynchronous: bool = False):
    """Write this rank's boxes (a collective: every rank calls it) into ``path``.partial, then commit it as
    ``path`` (module docstring). ``asynchronous``: dcp.async_save, which stages (copies) the state in memory,
    returns, and writes in a background thread on a gloo group of its own, committed when it is done. Returns the
    future (rank 0's result() waits for the commit; the next save or load waits for rank 0), or DCP's metadata.
    Refuses a folder it would replace that the course did not make (checkpoint_commit.check_ours)."""
    path = os.path.normpath(path)
    staging = path + PARTIAL
    unfinished.finish()                                  # one save at a time: an asynchronous one still writing
    torch.distributed.barrier()                          # ... and committed by rank 0
    check_ours(path)                                     # on every rank: the same verdict, so none waits alone
    torch.distributed.barrier()                          # every rank has looked before rank 0 makes the staging
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)     # an earlier save of this path that never finished
        os.makedirs(staging)
        open(os.path.join(staging, MARKER), "w").close()
    torch.distributed.barrier()
    state = course_state(data_parallel, mesh, rank, train)
    if asynchronous:
        # DCP's thread plans and writes with collectives while training goes on with its own on the default group:
        # on one group the two would pair wrongly (torch's async checkpointing recipe gives the save a gloo group)
        group = torch.distributed.new_group(backend="gloo")
        future = dcp.async_save(state, checkpoint_id=staging, planner=CourseSavePlanner(), process_group=group)
        return PendingSave(future, staging, path, commits=rank == 0, group=group)
    with one_line_errors(path, "saving"):
        metadata = dcp.save(state, checkpoint_id=staging, planner=CourseSavePlanner())
    torch.distributed.barrier()                          # every rank has written, rank 0 the .metadata
    if rank == 0:
        commit(staging, path)
    torch.distributed.barrier()                          # nobody reads ``path`` before it is there
    return metadata


def load(data_parallel, mesh, rank: int, path: str, train: dict, check=None) -> dict:
    """Read this rank's boxes, in whatever layout the checkpoint was saved, into ``data_parallel``'s shards and
    Adam state; set Adam's step counters and torch's RNG state; return the saved ``train`` dict (``train``: one of
    the same keys, e.g. train_state(0, ...), whose values are replaced). ZeRO-1/2 keep whole weights: after the
    shards are loaded the dp ranks all-gather them, as after an optimizer step. ``check(saved train)``, if given,
    refuses a checkpoint by raising, before anything of this rank is overwritten."""
    unfinished.finish()                      # an asynchronous save still writing, then rank 0's commit of it
    torch.distributed.barrier()
    folder = committed(path)
    verify_checksums(folder)
    saved = _read_train(folder, train)
    check_same_model(path, train.get("config", ""), saved.get("config", ""))
    if check is not None:
        check(saved)                         # before any state is overwritten
    state = course_state(data_parallel, mesh, rank, train)
    with one_line_errors(folder, "loading"):
        dcp.load(state, checkpoint_id=folder, planner=CourseLoadPlanner())
    data_parallel.regather_weights()
    resume_counters(data_parallel.optimizer, [unit.shard for unit in data_parallel.units], state["train"])
    return state["train"]


# -------------------------------------------------------------------- one process, no wrapper of the course

def plain_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train: dict) -> dict:
    """The same names for a whole model and torch's Adam in one process: plain tensors, one box each."""
    init_optimizer_state(optimizer, model.parameters())
    names = dict(model.named_parameters())
    return {"model": {n: p.detach() for n, p in names.items()},
            "optimizer": {"state": {n: {m: optimizer.state[p][m] for m in MOMENTS} for n, p in names.items()}},
            "train": train}


def load_plain(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, train: dict) -> dict:
    """Load a checkpoint of any layout into one process's model and Adam (no process group needed); ``train`` as
    for load (its config, if it names none, is the model's own)."""
    folder, solo = committed(path), dict(no_dist=not torch.distributed.is_initialized())
    verify_checksums(folder)
    train = {**train, "config": train.get("config") or config_text(getattr(model, "config", None))}
    state = plain_state(model, optimizer, train)
    with warnings.catch_warnings():   # without a process group DCP warns that it assumes one process: it is one
        warnings.simplefilter("ignore", UserWarning)
        check_same_model(path, train["config"], _read_train(folder, train, **solo).get("config", ""))
        with one_line_errors(folder, "loading"):
            dcp.load(state, checkpoint_id=folder, planner=DefaultLoadPlanner(), **solo)
    resume_counters(optimizer, model.parameters(), state["train"])
    return state["train"]


# ------------------------------------------------------------------------------------------ what was written

def written_bytes(path: str) -> dict[int, dict[str, int]]:
    """Per rank, from the checkpoint's own metadata: "state" (the bytes of the weight and Adam boxes it wrote,
    numel × itemsize), "records" (everything in its file: boxes, the step, the RNG state...) and "file" (its
    file's size on disk: the boxes plus torch.save's framing of each record, and rank 0's ``train``)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    per_file: dict[str, dict[str, int]] = {}
    for index, info in metadata.storage_data.items():
        entry = per_file.setdefault(info.relative_path, {"state": 0, "records": 0})
        entry["records"] += 1
        md = metadata.state_dict_metadata[index.fqn]
        if index.fqn.startswith(("model.", "optimizer.")):
            entry["state"] += md.chunks[index.index].sizes.numel() * md.properties.dtype.itemsize
    out = {}
    for name, entry in per_file.items():        # DCP names rank r's file __r_0.distcp
        rank = int(name.split("_")[2])
        out[rank] = {**entry, "file": os.path.getsize(os.path.join(path, name))}
    return dict(sorted(out.items()))


def latest(root: str) -> str | None:
    """The newest committed checkpoint under ``root`` (folders named so that they sort by step), or None: never a
    ``.partial`` folder (a save not yet committed, or cut), and a ``.replaced`` one only where its commit was cut
    between its two renames (it is then the checkpoint of that name; ``load`` finds it)."""
    if not os.path.isdir(root):
        return None
    names = {name.removesuffix(REPLACED) for name in os.listdir(root) if not name.endswith(PARTIAL)}
    done = []
    for name in sorted(names):
        try:
            committed(os.path.join(root, name))
            done.append(name)
        except FileNotFoundError:
            pass
    return os.path.join(root, done[-1]) if done else None
