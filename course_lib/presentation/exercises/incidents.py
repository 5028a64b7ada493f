"""The checkers of notebook 11's exercises (the pipeline's swap that cannot deadlock; the micro-batch loss that makes
gradient accumulation equal the big-batch step); the package's __init__ wraps and re-exports them."""

import torch

from ..incidents.common import reference, tiny
from ..incidents.hangs import pipeline_sends
from ..incidents.numerics import (
    IGNORE,
    mean_over_the_batch,
    mean_per_micro_batch,
    pad,
    token_mean,
    token_mean_reference,
)
from .common import NOT_DONE, run_on_ranks

ATOL = 1e-12    # float64: the same sums in another order
WORLD_SIZE, ACCUMULATION = 2, 4     # different, so that a loss off by one or by the other can be told apart


def _sample(loss_of, world_size: int = WORLD_SIZE, accumulation: int = ACCUMULATION):
    """One micro-batch (a row) of step 0 on rank 0, as token_mean hands it over: the learner's loss, the fix's and
    the bug's."""
    model, _, data = tiny()
    inputs, targets = data.batch(0, 8)
    targets = pad(targets, 0)
    real_tokens = (targets != IGNORE).sum()
    with torch.no_grad():
        logits = model(inputs[:1])
    kwargs = dict(real_tokens=real_tokens, world_size=world_size, accumulation=accumulation)
    return [float(fn(logits, targets[:1], **kwargs)) for fn in (loss_of, mean_over_the_batch, mean_per_micro_batch)]


def check_micro_batch_loss(loss_of) -> bool:
    """11: ``loss_of(logits, targets, *, real_tokens, world_size, accumulation)`` gets one micro-batch's logits
    [b, s, V] and targets [b, s] (padding = -100), the real tokens of the whole global batch, the number of ranks
    and of micro-batches, and returns the loss to call backward on, so that after the gradients are averaged over
    the ranks the step equals one process's on the whole batch (mean over its real tokens). Run live on 2 ranks
    with 4 micro-batches against the one-process float64 reference."""
    try:
        mine, right, bug = _sample(loss_of)
    except NotImplementedError:
        print(NOT_DONE)
        return False
    results = run_on_ranks(token_mean, WORLD_SIZE, loss_of=loss_of, accumulation=ACCUMULATION)
    if results is None:
        return False
    gap = (results[0]["weights"] - token_mean_reference()).abs().max().item()
    if gap <= ATOL:
        print(f"✓ correct: 3 accumulated steps on 2 ranks × 4 micro-batches equal one process's big-batch steps (largest weight gap "
              f"{gap:.1e})")
        return True
    print(f"✗ after 3 steps the weights are {gap:.2e} from one process's big-batch run.")
    if abs(mine - bug) <= ATOL * abs(bug):
        print("  That is the per-micro-batch mean: a micro-batch with fewer real tokens weighs as much as a full "
              "one. Sum the token losses (reduction='sum', ignore_index=-100) and divide by the whole batch's tokens")
    elif any(abs(mine * factor - right) <= 1e-9 * abs(right) for factor in (WORLD_SIZE, 1 / WORLD_SIZE)):
        print("  Off by the number of ranks: the gradients' average over the ranks divides by world_size, so the "
              "loss must be world_size times a rank's share")
    elif any(abs(mine * factor - right) <= 1e-9 * abs(right) for factor in (ACCUMULATION, 1 / ACCUMULATION)):
        print("  Off by the number of micro-batches: the whole batch's real tokens already count every micro-batch")
    else:
        print("  Each real token of the global batch must weigh the same: its loss / (the batch's real tokens)")
    return False


def check_pipeline_swap(swap) -> bool:
    """11: ``swap(comm, outgoing, incoming, peer)`` must send ``outgoing`` to rank ``peer`` of ``comm`` and fill
    ``incoming`` with what ``peer`` sends, at a moment when ``peer`` is doing the same: two pipeline stages in
    1F1B's steady state. Run live in incident 2's pipeline (2 stages, 3 steps), whose weights must equal one
    process's to 1e-12, within 10 s (a deadlock is reported with where each rank waits)."""
    try:
        swap(None, None, None, 0)            # an unfinished answer raises at once, before any rank starts
    except NotImplementedError:
        print(NOT_DONE)
        return False
    except Exception:                        # an answer that needs a real Comm: run it
        pass
    results = run_on_ranks(pipeline_sends, WORLD_SIZE, what="pipeline", timeout=10.0, swap=swap)
    if results is None:
        print("  Hint: a blocking send finishes only when its receive is posted. Post both at once (comm.exchange, "
              "torch's batch_isend_irecv), or let one rank receive first (comm.rank tells you which rank you are)")
        return False
    expected = {name: p.detach() for name, p in reference().named_parameters()}
    gap = max((weights - expected[name]).abs().max().item() for stage in results
              for name, weights in stage["weights"].items())
    if gap > ATOL:
        print(f"✗ no deadlock, but the stages' weights end {gap:.2e} from one process's: does ``incoming`` hold what "
              "the peer sent (filled in place) before you return?")
        return False
    print(f"✓ correct: no deadlock, and both stages' weights equal one process's (largest gap {gap:.1e})")
    return True
