"""exercises.check_lse_merge (notebook 07) given the typical wrong answers: each gets its own hint, ✗ and False
(tests/test_exercises.py runs it on its reference answer and on the notebook's unfinished cell)."""

import pytest
import torch
from test_exercises import NOT_DONE, unfinished, verdict

from course_lib.presentation import exercises


def average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def keeps_the_first_lse(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse_a


def naive_exponentials(out_a, lse_a, out_b, lse_b):
    """Right in exact arithmetic; e^1000 is inf in float64."""
    a, b = torch.exp(lse_a), torch.exp(lse_b)
    return (a[..., None] * out_a + b[..., None] * out_b) / (a + b)[..., None], torch.log(a + b)


def unnormalised(out_a, lse_a, out_b, lse_b):
    return (torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b,
            torch.logaddexp(lse_a, lse_b))


def weights_not_lined_up(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse


def in_place(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    out_a.mul_(torch.exp(lse_a - lse)[..., None])
    return out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


def out_only(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b


@pytest.mark.parametrize("answer, expected, words", [
    (unfinished, False, [NOT_DONE]),
    (average, False, ["✗ with ordinary scores", "an average weighs the two blocks equally"]),
    (keeps_the_first_lse, False, ["✗ with ordinary scores", "out is right but lse is not", "torch.logaddexp"]),
    (naive_exponentials, False, ["✗ with scores near 1000", "inf or nan", "exponents <= 0 never overflow"]),
    (unnormalised, False, ["✗ with ordinary scores", "weigh it by exp(L_A - L), not by exp(L_A)"]),
    (weights_not_lined_up, False, ["Your function failed on blocks of shape", "lse[..., None] lines them up"]),
    (in_place, False, ["✗ with ordinary scores: your function changed its inputs in place"]),
    (out_only, False, ["✗ with ordinary scores: return a pair (out, lse); got Tensor"]),
], ids=["unfinished", "average", "first lse", "overflow", "unnormalised", "broadcast", "in place", "out only"])
def test_check_lse_merge_says_what_is_wrong(capsys, answer, expected, words):
    verdict(capsys, exercises.check_lse_merge(answer), expected, *words)
