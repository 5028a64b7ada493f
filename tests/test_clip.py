"""Global gradient-norm clipping (course_lib.clip) over TP, PP, DP (ZeRO) and EP: each parameter counted once,
equal to one process's torch.nn.utils.clip_grad_norm_ in float64; torch's own on DTensor parameters beside it."""

import pytest
import torch

from course_lib.data import SyntheticTokens
from course_lib.model import build, loss_fn, preset
from course_lib.runs.checkpoint import DEFAULTS, LAYOUTS, save_and_resume, world_of
from course_lib.runs.clip import MOE, dtensor_norm, expert_parallel_norms, one_process_norm
from course_lib.runs.mesh import max_parameter_gap
from course_lib.runtime.launch import launch

MAX_NORM, STEPS, TOLERANCE = 0.5, 3, 1e-12


def clipped_one_process(steps=STEPS):
    """One process, torch's clip_grad_norm_ before every Adam step: the norms and the trained weights."""
    config = preset("tiny")
    model = build(config, seed=DEFAULTS["seed"], dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=DEFAULTS["lr"], foreach=False)
    data = SyntheticTokens(config.vocab_size, DEFAULTS["seq_len"], seed=DEFAULTS["seed"])
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model(data.batch(step, DEFAULTS["batch_size"])[0]), data.batch(step, DEFAULTS["batch_size"])[1]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
    return norms, model.state_dict()


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["dp2 tp2 pp2 zero1", "dp2 tp2 zero3", "dp2 tp2 ddp"])
def test_clipping_by_the_global_norm_over_tp_pp_and_dp_equals_one_process(name):
    layout = LAYOUTS[name]
    results = launch(save_and_resume, world_of(layout), layout=layout, steps=STEPS, root="", max_norm=MAX_NORM)
    norms, reference = clipped_one_process()
    assert min(norms) > MAX_NORM                      # every step was clipped: the norm decides the update
    for result in results:
        assert max(abs(a - b) for a, b in zip(result["norms"], norms)) < TOLERANCE
    assert max_parameter_gap(results, reference) < TOLERANCE


@pytest.mark.ranks
def test_the_global_norm_over_expert_parallel_ranks_counts_each_expert_once():
    config = preset("tiny", **MOE)
    results = launch(expert_parallel_norms, 4, ep=2)
    expected = one_process_norm(config)
    assert all(abs(r["norm"] - expected) < TOLERANCE for r in results)
    # The bad smell, exactly: every rank's squares of all it holds count the shared weights 4 times (dp 4) and
    # each expert twice (on the 2 ranks of its expert-dp group).
    model = build(config, seed=0, dtype=torch.float64)
    loss_fn(model(SyntheticTokens(config.vocab_size, 16, seed=0).batch(0, 8)[0]),
            SyntheticTokens(config.vocab_size, 16, seed=0).batch(0, 8)[1]).backward()
    experts = sum(p.grad.pow(2).sum().item() for n, p in model.named_parameters() if ".experts." in n)
    shared = sum(p.grad.pow(2).sum().item() for n, p in model.named_parameters() if ".experts." not in n)
    assert abs(results[0]["naive"] - (4 * shared + 2 * experts) ** 0.5) < TOLERANCE
    assert all(abs(r["shared_counted"] - 4) < TOLERANCE for r in results)     # what notebook 10 reveals


@pytest.mark.ranks
def test_torch_clip_grad_norm_on_dtensor_parameters_equals_one_process():
    expected = one_process_norm()
    assert all(abs(norm - expected) < TOLERANCE for norm in launch(dtensor_norm, 4, dp=2))
