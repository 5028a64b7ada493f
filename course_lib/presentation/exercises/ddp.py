"""Notebook 02's exercise: a data-parallel step with gradient accumulation."""

import torch
from torch.nn.utils import parameters_to_vector

from ...comm import Comm
from ...ddp import BucketedDDP
from . import common
from .common import exercise, run_on_ranks


@exercise
def check_accumulation_step(accumulation_step, world_size: int = 2, num_microbatches: int = 3) -> bool:
    """02: ``accumulation_step(ddp, optimizer, micro_batches, loss_fn)`` must run one optimizer step of
    gradient accumulation on a ``course_lib.ddp.BucketedDDP``: every micro-batch's forward and backward,
    gradients all-reduced once (after the last micro-batch), then the update. Checked on ``world_size`` ranks
    against one process on the global batch, and by counting the all-reduces it issued."""

    def trial(rank, world_size):
        model = _seeded_model()
        comm = Comm()
        ddp = BucketedDDP(model, comm, bucket_bytes=256)       # a few buckets
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        data = torch.Generator().manual_seed(1)
        rows = [(torch.randn(2 * world_size, 8, generator=data), torch.randn(2 * world_size, 4, generator=data))
                for _ in range(num_microbatches)]                # every micro-batch of every rank
        mine = [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]) for x, y in rows]
        synced = []   # one entry per backward: True if it ran outside no_sync(), so its buckets were all-reduced
        model[0].weight.register_post_accumulate_grad_hook(lambda _: synced.append(ddp.require_sync))
        with comm.trace() as log:
            try:
                accumulation_step(ddp, optimizer, mine, torch.nn.functional.mse_loss)
            except RuntimeError:
                if not synced or any(synced):
                    raise
                # Every backward ran inside no_sync(): finish_gradient_sync() then finds no bucket all-reduced
                # and blames unused parameters. The real cause is said below, in the notebook.
        calls = log.summary().get("all_reduce")
        params = parameters_to_vector(model.parameters()).detach()
        return params, calls.count if calls else 0, len(ddp.buckets), rows, synced

    results = run_on_ranks(trial, world_size, timeout=2 * common.TIMEOUT_SECONDS)   # a model to build: more slack
    if results is None:
        return False
    return _judge(results, num_microbatches, world_size)


def _seeded_model() -> torch.nn.Module:
    """The exercise's small MLP, with the same initial weights on every rank and in the one-process reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _one_process(rows, num_microbatches: int, divide: bool) -> torch.Tensor:
    """The weights after one SGD step of one process on the whole global batch ``rows``.

    With ``divide`` the loss is the mean over all N rows, L = (1/N)·Σᵢ ℓᵢ, the loss that accumulation must
    reproduce; without it the loss is M·L for M = ``num_microbatches``: what summing M undivided micro-batch
    means gives."""
    model = _seeded_model()
    x, y = torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
    loss = torch.nn.functional.mse_loss(model(x), y) * (1 if divide else num_microbatches)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return parameters_to_vector(model.parameters()).detach()


def _judge(results, num_microbatches: int, world_size: int) -> bool:
    """Print what the ranks' ``results`` say about the learner's step (the first mistake found, or ✓) and
    return whether it passed."""
    params, count, buckets, rows, synced = results[0]
    if not synced:
        print("✗ no backward ran: call .backward() on each micro-batch's loss")
        return False
    if not any(synced):
        print("✗ no gradient was ever all-reduced: every micro-batch, the last one included, ran inside no_sync(). "
              "The last one must run outside it, so that its backward all-reduces the gradients accumulated over "
              "all micro-batches; then ddp.finish_gradient_sync() waits for them")
        return False
    if count == num_microbatches * buckets:
        print(f"✗ {count} all-reduces: you synced after every one of the {num_microbatches} micro-batches. Run the "
              "inner ones inside `with ddp.no_sync():` so only the last backward sends the summed gradients.")
        return False
    if any(not torch.equal(other[0], params) for other in results[1:]):
        print("✗ the ranks ended with different weights: call ddp.finish_gradient_sync() before optimizer.step()")
        return False
    # 1e-6: the same sums in another order (fp32), on weights of size ~1; a wrong scale is off by ~1e-2
    too_large = _one_process(rows, num_microbatches, divide=False)
    if torch.allclose(params, too_large, atol=1e-6) and num_microbatches > 1:
        print(f"✗ the gradient is {num_microbatches}x too large: divide each micro-batch's loss by the number of "
              "micro-batches, so that the summed gradients are the gradient of the mean loss")
        return False
    if not torch.allclose(params, _one_process(rows, num_microbatches, divide=True), atol=1e-6):
        print("✗ the weights differ from one process training on the whole global batch (did you zero the "
              "gradients once, before the first micro-batch, and step once, after the sync?)")
        return False
    print(f"✓ correct: {count} all-reduce(s) for {num_microbatches} micro-batches ({buckets} buckets, one sync), "
          f"and the same weights as one process on all {num_microbatches * 2 * world_size} rows")
    return True
