"""exercises.check_expert_exchange (notebook 08) given the typical wrong answers: each gets its own hint, ✗ and
False (tests/test_exercises.py runs it on its reference answer and on the notebook's unfinished cell)."""

import pytest
import torch
from test_exercises import NOT_DONE, unfinished, verdict

from course_lib.presentation import exercises

pytestmark = pytest.mark.ranks   # every answer runs on 2 and 4 ranks


def exchange(buffer, comm):
    received = torch.empty_like(buffer)
    comm.all_to_all(received, buffer)
    return received


def run_mine(received, experts, comm):
    """Each of this rank's experts on its rows from every rank: [E, C, d] in, [ep, E/ep, C, d] out."""
    received = received.view(comm.size, len(experts), *received.shape[1:])
    return torch.stack([expert(received[:, i]) for i, expert in enumerate(experts)], dim=1)


def no_exchange(buffer, experts, comm):
    """This rank's experts on this rank's own slots for them; the other slots left as they were."""
    out = buffer.clone()
    first = comm.rank * len(experts)
    for i, expert in enumerate(experts):
        out[first + i] = expert(buffer[first + i])
    return out


def dispatch_only(buffer, experts, comm):
    return run_mine(exchange(buffer, comm), experts, comm).reshape(buffer.shape)


def rows_by_expert_first(buffer, experts, comm):
    """Reads the received chunks as [E/ep, ep, C, d]: the source rank and the expert swapped (at ep = 2 experts 0
    and 4, index 0 of both views, still come out right)."""
    received = exchange(buffer, comm).view(len(experts), comm.size, *buffer.shape[1:])
    outputs = torch.stack([expert(received[i]) for i, expert in enumerate(experts)])
    return exchange(outputs.reshape(buffer.shape), comm)


def with_an_all_reduce(buffer, experts, comm):
    comm.all_reduce(torch.zeros(1, dtype=buffer.dtype))
    return exchange(run_mine(exchange(buffer, comm), experts, comm).reshape(buffer.shape), comm)


def three_exchanges(buffer, experts, comm):
    exchange(buffer, comm)
    return exchange(run_mine(exchange(buffer, comm), experts, comm).reshape(buffer.shape), comm)


def by_rank_and_expert(buffer, experts, comm):
    """Right values, returned as [ep, E/ep, C, d]."""
    combined = exchange(run_mine(exchange(buffer, comm), experts, comm).reshape(buffer.shape), comm)
    return combined.view(comm.size, len(experts), *buffer.shape[1:])


def combine_on_rank_0_only(buffer, experts, comm):
    """The hang of a learner: the combine inside an `if` that only rank 0 takes."""
    outputs = run_mine(exchange(buffer, comm), experts, comm).reshape(buffer.shape)
    return exchange(outputs, comm) if comm.rank == 0 else outputs


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (no_exchange, ["✗ on 2 ranks, rank 0: no traced collective. Rank 0 holds experts 0–3 only",
                   "comm.all_to_all(output, input)"]),
    (dispatch_only, ["✗ on 2 ranks, rank 0: one all-to-all", "a second all_to_all (the combine)"]),
    (rows_by_expert_first, ["✗ on 2 ranks, rank 0: the outputs for experts [1, 2, 3, 5, 6, 7] are not",
                            "view it as [ep, E/ep, C, d]"]),
    (with_an_all_reduce, ["✗ on 2 ranks, rank 0: traced ['all_reduce', 'all_to_all', 'all_to_all']"]),
    (three_exchanges, ["✗ on 2 ranks, rank 0: 3 all-to-alls; one to dispatch and one to combine are enough"]),
    (by_rank_and_expert, ["✗ on 2 ranks, rank 0: expected a tensor of the buffer's shape (8, 5, 64), got "
                          "(2, 4, 5, 64)"]),
    (combine_on_rank_0_only, ["✗ the ranks' collective calls diverge. Calls per op on each rank: rank 0 "
                              "all_to_all × 2; rank 1 all_to_all × 1. Ranks [1] returned from your exchange; "
                              "ranks [0] did not", "is a call inside an `if` on the rank?"]),
], ids=["unfinished", "no-exchange", "dispatch-only", "wrong-layout", "other-collective", "three", "wrong-shape",
        "hang-on-rank-0"])
def test_check_expert_exchange_says_what_is_wrong(capsys, answer, words):
    verdict(capsys, exercises.check_expert_exchange(answer), False, *words)
