"""The checkers of notebook 11's exercises, one per incident it fixes: each runs the learner's function live inside
the incident's job and accepts it only when the hang is gone and the run equals the one-process reference. The
package's __init__ wraps and re-exports them."""

import tempfile

import torch

from ..incidents.common import BATCH_SIZE, STEPS, flat, gap, reference, tiny
from ..incidents.hangs import pipeline_sends, uneven_shards
from ..incidents.numerics import (
    IGNORE,
    LOSS_SCALE,
    flushed,
    fp16_loss_scale,
    fp16_reference,
    mean_over_the_batch,
    mean_per_micro_batch,
    pad,
    token_mean,
    token_mean_reference,
)
from ..incidents.replicas import MOMENTUM, same_batch, unsynced_init, zero_resume
from .common import NOT_DONE, run_on_ranks

ATOL = 1e-12    # float64: the same sums in another order
WORLD_SIZE, ACCUMULATION = 2, 4     # different, so that a loss off by one or by the other can be told apart
HANG_SECONDS = 10.0                 # the incidents' ranks finish in a second or two: still running after this, a hang
DATASET_ROWS = STEPS * BATCH_SIZE - 1     # incident 1's dataset


def _unfinished(answer, *args) -> bool:
    """Call ``answer`` on sample arguments: True (and "not done yet" said) if it still raises
    NotImplementedError, so that no rank starts for an unfinished answer. Any other error is left for the ranks
    to report."""
    try:
        answer(*args)
    except NotImplementedError:
        print(NOT_DONE)
        return True
    except Exception:           # an answer that needs a live rank (a Comm, a process group): run it
        pass
    return False


def _against_reference(distance: float, wrong: str, right: str) -> bool:
    """The verdict on a run whose weights end ``distance`` from the one-process reference: "✗ ``wrong``" beyond
    ATOL, else "✓ correct: ``right``"."""
    if distance > ATOL:
        print(f"✗ {wrong}")
        return False
    print(f"✓ correct: {right}")
    return True


def check_step_count(steps_of) -> bool:
    """11: ``steps_of(dataset_rows, my_rows, world_size, batch_size)`` returns how many steps of ``batch_size``
    rows (the global batch) this rank takes in an epoch, ``my_rows`` being its share of the dataset's rows. Run
    live in incident 1's job (23 rows on 2 ranks): it must end within 10 s, after the dataset's whole global
    batches, with the weights of one process trained on them."""
    if _unfinished(steps_of, DATASET_ROWS, -(-DATASET_ROWS // WORLD_SIZE), WORLD_SIZE, BATCH_SIZE):   # rank 0's
        return False
    results = run_on_ranks(uneven_shards, WORLD_SIZE, what="epoch", timeout=HANG_SECONDS, steps_of=steps_of)
    if results is None:
        print("  Hint: rank 0 holds 12 rows and rank 1 holds 11. Counted from each rank's own rows, rank 0 takes a "
              "step more, and its all-reduce waits for a rank that has finished. Count from what every rank "
              "knows alike: dataset_rows")
        return False
    steps, whole = results[0]["steps"], DATASET_ROWS // BATCH_SIZE
    if steps != whole:
        why = ("some of the data is never read" if steps < whole else
               "the last global batch is short, so the ranks' shares of it differ and the average weighs them wrongly")
        print(f"✗ no hang, but {steps} steps, where the dataset holds {whole} whole global batches of {BATCH_SIZE}: "
              f"{why}. Take only whole global batches (drop_last)")
        return False
    distance = max(gap(r["weights"], flat(reference(whole))) for r in results)
    return _against_reference(distance, f"{steps} steps on every rank, but the weights end {distance:.2e} from one "
                              "process's", f"{steps} steps on both ranks, no hang, and the weights equal one "
                              f"process's (largest gap {distance:.1e})")


def check_replica_sync(sync) -> bool:
    """11: ``sync(model, comm)`` runs once on every rank before the first step, each rank's model built from its
    own seed (incident 3). Afterwards the replicas must be equal, and after 3 data-parallel steps equal to the
    one-process oracle, which starts from the model rank 0 built (seed 0)."""
    if _unfinished(sync, None, None):
        return False
    results = run_on_ranks(unsynced_init, WORLD_SIZE, what="sync", sync=sync)
    if results is None:
        return False
    sums = results[0]["checksums"]
    if sums[0] != sums[1]:
        print(f"✗ the replicas still differ after 3 steps (checksums {sums[0]:.6f} and {sums[1]:.6f}): every "
              "weight of one rank must reach every rank, in place (comm.broadcast(tensor, src), under "
              "torch.no_grad())")
        return False
    distance = gap(results[0]["weights"], flat(reference()))
    return _against_reference(
        distance, f"the replicas agree, but on a model {distance:.2e} from the oracle's: not the one rank 0 built "
        "(seed 0), the model every run of this job starts from. Averaging the replicas, or broadcasting another "
        "rank's, gives equal replicas of a model no one initialised",
        f"equal replicas, and after 3 steps the weights equal one process's (largest gap {distance:.1e})")


def check_rank_rows(rows_of) -> bool:
    """11: ``rows_of(batch, rank, world_size)`` returns the rows of a step's global batch this rank trains on.
    Every row must go to exactly one rank, as many to each; then, run live (incident 3's second job), the
    weights must equal one process's trained on the whole batch."""
    if _unfinished(rows_of, torch.arange(BATCH_SIZE), 0, WORLD_SIZE):
        return False
    labels = torch.arange(BATCH_SIZE)             # each row labelled by its index: whose rows are whose
    taken = [rows_of(labels, rank, WORLD_SIZE).tolist() for rank in range(WORLD_SIZE)]
    every = sorted(row for rows in taken for row in rows)
    if every != labels.tolist() or len({len(rows) for rows in taken}) != 1:
        twice = sorted({row for row in every if every.count(row) > 1})
        missed = sorted(set(labels.tolist()) - set(every))
        print(f"✗ of a batch of {BATCH_SIZE} rows, rank 0 takes {taken[0]} and rank 1 takes {taken[1]}"
              + (f"; read twice: {twice}" if twice else "") + (f"; read by no rank: {missed}" if missed else "")
              + ". Each row must go to exactly one rank, the same number to each")
        return False
    results = run_on_ranks(same_batch, WORLD_SIZE, what="rows", rows_of=rows_of)
    if results is None:
        return False
    distance = max(gap(r["weights"], flat(reference())) for r in results)
    return _against_reference(distance, f"the weights end {distance:.2e} from one process's on the whole batch",
                              f"rank 0 takes rows {taken[0]}, rank 1 {taken[1]}, and the weights equal one "
                              f"process's (largest gap {distance:.1e})")


def check_resume_load(load) -> bool:
    """11: ``load(folder, rank)`` returns the optimizer state rank ``rank`` resumes from, in incident 4's ZeRO-1
    job (each rank saved its shard's state with torch.save to ``optimizer_file(folder, rank)``, a
    pathlib.Path). The resumed run must equal the uninterrupted one."""
    with tempfile.TemporaryDirectory() as root:     # the course's own folder, gone after the check
        if _unfinished(load, root, 0):
            return False
        results = run_on_ranks(zero_resume, WORLD_SIZE, what="resume", root=root, load=load)
    if results is None:
        return False
    distance = gap(results[0]["weights"], flat(reference(momentum=MOMENTUM)))
    return _against_reference(
        distance, f"the resumed run ends {distance:.2e} from the uninterrupted one. Under ZeRO-1 each rank's "
        "optimizer state is the momentum of its own shard of the weights, saved as optimizer_file(folder, rank)",
        f"the resumed run equals the uninterrupted one (largest gap {distance:.1e})")


def check_fp16_step(step) -> bool:
    """11: ``step(loss, optimizer, scaler, sync)`` ends a step of incident 8's fp16 job: backward from the
    micro-batch's ``loss``, ``sync()`` to average the gradients over the ranks, and the optimizer's step;
    ``scaler`` is a torch.amp.GradScaler, if you want it. Run live for 10 steps: step 0's gradient, as the
    optimizer sees it, must match float64's to fp16's precision (no entry flushed to zero, relative error below
    2e-3), and the losses must follow the float64 run's (within 0.05)."""
    if _unfinished(step, None, None, None, lambda: None):
        return False

    def explain(summary: str):
        if "_scale is None" in summary or "No inf checks were recorded" in summary:     # GradScaler's words
            return ("✗ scaler.step(optimizer) found no gradients that the scaler scaled: call backward on "
                    "scaler.scale(loss), not on loss")
        return None

    results = run_on_ranks(fp16_loss_scale, WORLD_SIZE, what="step", explain=explain, step_of=step)
    if results is None:
        return False
    if results[0]["gradient"] is None:
        print("✗ the optimizer never took a step: call optimizer.step() (or scaler.step(optimizer))")
        return False
    expected = fp16_reference()
    gradient, truth = results[0]["gradient"].double(), expected["gradient"]
    zeros, ratio = flushed(gradient, truth), (gradient.norm() / truth.norm()).item()
    error = ((gradient - truth).norm() / truth.norm()).item()
    drift = max(abs(a - b) for a, b in zip(results[0]["losses"], expected["losses"]))
    if zeros > 1e-3:
        print(f"✗ {zeros:.0%} of step 0's gradient entries came out exactly 0 (float64's are not): the backward ran "
              "on a loss so small that fp16 rounds its gradients away. Scale the loss up before backward "
              "(scaler.scale(loss)), and the gradients back down before the step")
    elif not 0.5 < ratio < 2:
        print(f"✗ the optimizer saw gradients {ratio:.3g} times float64's: divide them by the loss's scale before "
              f"the step (scaler.step(optimizer) does; a scale of {LOSS_SCALE:.0f} is GradScaler's first)")
    elif error > 2e-3 or drift > 0.05:
        print(f"✗ step 0's gradient is {error:.1e} from float64's (relative) and the losses drift {drift:.3f} from "
              "its run's")
    else:
        print(f"✓ correct: no gradient flushed to zero, step 0's within {error:.0e} of float64's, and the losses "
              f"within {drift:.3f} of its run")
        return True
    return False


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
    if _unfinished(swap, None, None, None, 0):
        return False
    results = run_on_ranks(pipeline_sends, WORLD_SIZE, what="pipeline", timeout=HANG_SECONDS, swap=swap)
    if results is None:
        print("  Hint: a blocking send finishes only when its receive is posted. Post both at once (comm.exchange, "
              "torch's batch_isend_irecv), or let one rank receive first (comm.rank tells you which rank you are)")
        return False
    expected = {name: p.detach() for name, p in reference().named_parameters()}
    gap = max((weights - expected[name]).abs().max().item() for stage in results
              for name, weights in stage["weights"].items())
    return _against_reference(
        gap, f"no deadlock, but the stages' weights end {gap:.2e} from one process's: does ``incoming`` hold what "
        "the peer sent (filled in place) before you return?",
        f"no deadlock, and both stages' weights equal one process's (largest gap {gap:.1e})")
