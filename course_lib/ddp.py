"""Data parallelism (DDP) by hand: every rank holds the whole model and takes its own slice of the batch, and
the ranks average their gradients before every update, so the replicas never drift apart.

Why the average is right. A global batch of B = b·W samples split evenly over W ranks has the mean loss
L = (1/W)·Σ_r L_r, where L_r is rank r's mean over its b samples, so its gradient is the mean of theirs:

    g = ∇L = (g_0 + g_1 + ... + g_{W-1}) / W                 (two ranks: g = (g0 + g1) / 2)

One all-reduce (sum), then a division by W, gives every rank this g; every rank then applies the same update
to the same weights, and the replicas stay identical. With gradient accumulation over A micro-steps (each loss
divided by A, gradients summed locally) the global batch is b × W × A, e.g. 4 × 2 × 2 = 16.

Cost per optimizer step, for n gradient bytes: the all-reduce sends 2(W-1)/W · n bytes per rank on a ring
(reduce-scatter, then all-gather, (W-1)/W · n each; see comm.py), however many micro-steps there are.
Memory: every rank keeps the full weights, gradients and optimizer state, so DDP saves none.

Three implementations, in the order the notebook builds them (all share ``no_sync()`` and the training step):

* :class:`NaiveDDP`: after backward, all-reduce each gradient tensor in turn. Nothing is sent before the
  whole backward has finished, so all of the communication adds to the step time.
* :class:`BucketedDDP`: gradients are grouped into buckets of about ``bucket_bytes``, in reverse order of the
  parameters, because backward produces the last layer's gradients first. A hook on each parameter counts
  the gradients that are ready; when a bucket is complete it is flattened and all-reduced *asynchronously*
  while backward goes on with earlier layers. ``finish_gradient_sync()`` waits for what is still in flight:
  only that *exposed* communication adds to the step time. Small buckets start sending sooner but pay the
  fixed latency α of a collective more often (comm.CostModel: time = α + bytes/β).
* ``torch.nn.parallel.DistributedDataParallel``: the same design in C++ (25 MiB buckets by default).

:func:`ring_all_reduce` is the all-reduce written out with sends and receives, for the notebook's pictures.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn as nn

from .comm import Comm
from .units import MiB


def broadcast_parameters(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Make every rank's weights (and buffers) equal to rank ``src``'s: replicas must start identical."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            comm.broadcast(tensor.detach(), src)


def bucket_indices(param_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group parameters (given by their sizes in bytes, in registration order) into buckets, last parameter
    first. A bucket closes before a parameter that would take it past ``bucket_bytes``; a parameter larger
    than that gets a bucket of its own. Returns the parameter indices of each bucket, in launch order."""
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: a bucket size must be a positive number of bytes")
    buckets, current, current_bytes = [], [], 0
    for index in reversed(range(len(param_bytes))):
        if current and current_bytes + param_bytes[index] > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += param_bytes[index]
    return buckets + [current] if current else buckets


class _DataParallel(nn.Module):
    """What both hand-written versions share: identical replicas at the start, forward, ``no_sync()``."""

    def __init__(self, module: nn.Module, comm: Comm):
        super().__init__()
        self.module, self.comm = module, comm
        self.require_sync = True   # False inside no_sync(): gradients only accumulate locally
        self.bucket_log: list[dict] | None = None  # set to [] to record when each bucket's all-reduce ran
        broadcast_parameters(module, comm)
        self._names = {id(p): name for name, p in module.named_parameters()}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside this block only accumulate gradients (the inner micro-steps of
        gradient accumulation); the next synced backward all-reduces the accumulated sum once."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _check_sync_allowed(self):
        if not self.require_sync:
            raise RuntimeError("finish_gradient_sync() was called inside no_sync(): call it once per optimizer "
                               "step, after the last micro-step's backward, outside no_sync()")

    def _record(self, bucket: int, nbytes: int, issued: float, work=None) -> dict | None:
        """If recording, note when an all-reduce was issued, and when it finished: now, or (``work`` of an
        async one) when its future completes."""
        if self.bucket_log is None:
            return None
        entry = {"bucket": bucket, "bytes": nbytes, "issued": issued}
        self.bucket_log.append(entry)
        if work is None:
            entry["done"] = time.perf_counter()
        else:
            work.get_future().add_done_callback(lambda _: entry.setdefault("done", time.perf_counter()))
        return entry


class NaiveDDP(_DataParallel):
    """All-reduce every gradient after backward, one tensor at a time: simple, and nothing overlaps."""

    def finish_gradient_sync(self) -> None:
        self._check_sync_allowed()
        for i, param in enumerate(self.module.parameters()):
            if param.grad is None:
                raise RuntimeError(f"parameter {self._names[id(param)]} has no gradient: every parameter must "
                                   "take part in the loss on every rank (or the ranks disagree on what to send)")
            issued = time.perf_counter()
            self.comm.all_reduce(param.grad)            # the sum over ranks, in place, on every rank
            self._record(i, param.grad.nbytes, issued)
            param.grad /= self.comm.size                # the mean


def remove_with(wrapper, handles: list) -> None:
    """Remove the hooks behind ``handles`` once ``wrapper`` (whose methods they call, through a weak reference) is
    collected: a module that outlives its wrapper then trains on as a plain module."""
    weakref.finalize(wrapper, lambda: [handle.remove() for handle in handles])


class BucketedDDP(_DataParallel):
    """All-reduce buckets of gradients asynchronously as backward produces them; wait before the update."""

    def __init__(self, module: nn.Module, comm: Comm, bucket_bytes: int = 25 * MiB):
        super().__init__(module, comm)
        params = [p for p in module.parameters() if p.requires_grad]
        self.bucket_bytes = bucket_bytes
        self.buckets = [[params[i] for i in indices]
                        for indices in bucket_indices([p.nbytes for p in params], bucket_bytes)]
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._ready = [0] * len(self.buckets)     # gradients ready in each bucket during this backward
        self._in_flight: list[tuple[torch.Tensor, object, dict | None]] = []   # (flat buffer, work, record)
        wrapper = weakref.proxy(self)   # held weakly: a strong one keeps a finished run's model alive (zero.py)
        remove_with(self, [param.register_post_accumulate_grad_hook(lambda param: wrapper._gradient_ready(param))
                           for param in params])

    def _gradient_ready(self, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` holds this backward's (accumulated) gradient."""
        if not self.require_sync:
            return
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        if self._ready[b] > len(self.buckets[b]):
            raise RuntimeError(f"the gradient of {self._names[id(param)]} was ready twice before "
                               "finish_gradient_sync(): call it after every synced backward, and run the inner "
                               "micro-steps of gradient accumulation inside no_sync()")
        # Launch buckets strictly in order, so that every rank issues the same all-reduces in the same order.
        while (len(self._in_flight) < len(self.buckets)
               and self._ready[len(self._in_flight)] == len(self.buckets[len(self._in_flight)])):
            self._launch(len(self._in_flight))

    def _launch(self, b: int) -> None:
        # Divide first (as torch does): the sum of W gradients already divided by W is the mean.
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]]).div_(self.comm.size)
        issued = time.perf_counter()
        work = self.comm.all_reduce(flat, async_op=True)
        self._in_flight.append((flat, work, self._record(b, flat.nbytes, issued, work)))

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce and copy the averaged gradients back into ``param.grad``."""
        self._check_sync_allowed()
        if len(self._in_flight) < len(self.buckets):
            missing = [self._names[id(p)] for bucket in self.buckets[len(self._in_flight):] for p in bucket
                       if p.grad is None]
            if not self._in_flight and not missing:   # every gradient is there, none was handed to a bucket
                raise RuntimeError("no gradient was all-reduced since the last finish_gradient_sync(): no backward "
                                   "ran outside no_sync() since then. Call it once per step, after the last "
                                   "micro-batch's backward, which runs outside no_sync()")
            raise RuntimeError(f"{len(self.buckets) - len(self._in_flight)} of {len(self.buckets)} buckets were "
                               f"never complete; parameters without a gradient: {missing or 'none'}. Every "
                               "parameter must take part in the loss (torch's DDP has find_unused_parameters)")
        for (flat, work, entry), bucket in zip(self._in_flight, self.buckets):
            work.wait()
            if entry is not None:
                entry.setdefault("done", time.perf_counter())
            for param, averaged in zip(bucket, flat.split([p.numel() for p in bucket])):
                param.grad.copy_(averaged.view_as(param))
        self._in_flight, self._ready = [], [0] * len(self.buckets)


# ---------------------------------------------------------------------------------------- the ring


def ring_all_reduce(tensor: torch.Tensor, comm: Comm, snapshots: list | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``comm`` in place, as a ring does it, with sends and receives only.

    The tensor is cut into p chunks. Reduce-scatter: in step s = 0..p-2, rank r sends chunk (r - s) mod p
    to its right neighbour and adds the chunk (r - s - 1) mod p that arrives from its left; after p-1 steps
    rank r holds the full sum of chunk (r + 1) mod p. All-gather: in p-1 more steps each rank passes the
    finished chunks around the ring, copying instead of adding. Each step moves n/p bytes per rank, so a rank
    sends 2(p-1)·n/p bytes in all: the ring formula. ``snapshots`` (a list) gets, after every step,
    (phase, step, [each chunk's first element]) for the notebook's pictures.
    """
    p, r = comm.size, comm.rank
    chunks = tensor.view(-1).tensor_split(p)          # views into tensor; sizes differ by at most 1
    right, left = (r + 1) % p, (r - 1) % p

    def exchange(send_index, recv_index):
        incoming = torch.empty_like(chunks[recv_index])
        # Blocking send/recv: if every rank sent first, all would wait for a receiver. Even ranks send first,
        # odd ranks receive first, so every ring (odd p too) has a rank that receives.
        if r % 2 == 0:
            comm.send(chunks[send_index], right)
            comm.recv(incoming, left)
        else:
            comm.recv(incoming, left)
            comm.send(chunks[send_index], right)
        return incoming

    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            if phase == "reduce-scatter":
                send_index, recv_index = (r - s) % p, (r - s - 1) % p
                chunks[recv_index].add_(exchange(send_index, recv_index))
            else:
                send_index, recv_index = (r + 1 - s) % p, (r - s) % p
                chunks[recv_index].copy_(exchange(send_index, recv_index))
            if snapshots is not None:
                snapshots.append((phase, s, [c[0].item() if c.numel() else None for c in chunks]))
    return tensor
