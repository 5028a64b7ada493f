"""exercises.check_global_norm (notebook 10) given the typical wrong answers: each gets its own hint, ✗ and False
(tests/test_exercises.py runs it on its reference answer and on the notebook's unfinished cell)."""

import pytest
import torch
from test_exercises import NOT_DONE, unfinished, verdict

from course_lib.presentation import exercises

pytestmark = pytest.mark.ranks   # every answer runs on 2 and 4 ranks


def local_only(grads, is_split, tp_rank, comm):
    return torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))


def replicas_counted_on_every_rank(grads, is_split, tp_rank, comm):
    total = sum(g.double().pow(2).sum() for g in grads.values())
    comm.all_reduce(total)
    return total.sqrt()


def norms_added(grads, is_split, tp_rank, comm):
    total = sum(g.double().norm() for name, g in grads.items() if is_split[name] or tp_rank == 0)
    comm.all_reduce(total)
    return total


@pytest.mark.parametrize("answer, words", [
    (unfinished, [NOT_DONE]),
    (local_only, ["✗ on 2 ranks, rank 0: no traced collective"]),
    (replicas_counted_on_every_rank, ["✗ on 2 ranks, rank 0:", "you counted the replicated gradients (norms, "
                                      "embedding, head) on all 2 ranks, 2 times"]),
    (norms_added, ["✗ on 2 ranks, rank 0:", "add the squares (not the norms)"]),
], ids=["unfinished", "local-only", "replicas-twice", "norms-added"])
def test_check_global_norm(capsys, answer, words):
    verdict(capsys, exercises.check_global_norm(answer), False, *words)
