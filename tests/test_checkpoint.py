"""Distributed checkpoints (course_lib.checkpoint): the course's ZeRO and TP shards saved with DCP in one layout
and loaded into others; the continued run equals one process trained without a break (float64, 1e-12)."""

import functools

import pytest
import torch

from course_lib import checkpoint
from course_lib.mesh import Mesh
from course_lib.model import build, count_params, preset
from course_lib.per_rank import checkpoint_bytes
from course_lib.runs.checkpoint import DEFAULTS, LAYOUTS, save_and_resume, world_of
from course_lib.runs.mesh import max_parameter_gap
from course_lib.runtime.launch import launch
from course_lib.train import reference_run, training_step

SAVE_AT, STEPS = 3, 6
TOLERANCE = 1e-12


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4)])
def test_flat_range_boxes_cover_the_range_once_in_order(shape):
    numel = torch.Size(shape).numel()
    index = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            covered = [index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                       for offsets, sizes in checkpoint.flat_range_boxes(start, stop, shape)]
            assert (torch.cat(covered).tolist() if covered else []) == list(range(start, stop))
            assert len(covered) <= 3


def test_flat_range_boxes_refuse_a_range_outside_the_tensor():
    with pytest.raises(ValueError, match=r"\[3, 9\) is not a range of the 8 elements of \(2, 4\)"):
        checkpoint.flat_range_boxes(3, 9, (2, 4))


@functools.cache
def reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    kw = {k: DEFAULTS[k] for k in ("batch_size", "seq_len", "lr", "seed")}
    return reference_run(steps=steps, dtype=torch.float64, **kw)[1].state_dict()


def resume_in_one_process(path: str) -> dict[str, torch.Tensor]:
    """Load ``path`` into a whole model and torch's Adam (no process group, no course wrapper) and finish there."""
    from course_lib.data import SyntheticTokens
    config = preset("tiny")
    model = build(config, seed=DEFAULTS["seed"], dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=DEFAULTS["lr"], foreach=False)
    train = checkpoint.load_plain(model, optimizer, path, checkpoint.train_state(0, seed=0, batch_size=0))
    data = SyntheticTokens(config.vocab_size, DEFAULTS["seq_len"], seed=DEFAULTS["seed"])
    for step in range(train["data"]["next_step"], STEPS):
        training_step(model, optimizer, *data.batch(step, DEFAULTS["batch_size"]))
    return model.state_dict()


@pytest.fixture(scope="module", params=["dp2 tp2 pp2 zero1", "dp2 tp2 zero3"])
def saved(request, tmp_path_factory):
    """A run in the layout, saved after SAVE_AT steps (and trained on to STEPS without a break)."""
    root = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    layout = LAYOUTS[request.param]
    results = launch(save_and_resume, world_of(layout), layout=layout, steps=STEPS, root=str(root), save_at=SAVE_AT)
    return request.param, root / f"step_{SAVE_AT}", results


@pytest.mark.ranks
def test_the_saving_run_itself_equals_one_process(saved):
    _, _, results = saved
    assert max_parameter_gap(results, reference()) < TOLERANCE


@pytest.mark.ranks
@pytest.mark.parametrize("target", ["tp4 dp2 zero1", "pp4", "dp4 zero3"])
def test_resumed_in_another_layout_the_run_equals_one_process_never_stopped(saved, target):
    layout = LAYOUTS[target]
    results = launch(save_and_resume, world_of(layout), layout=layout, steps=STEPS, root="", resume_from=str(saved[1]))
    assert all(len(r["losses"]) == STEPS - SAVE_AT for r in results)
    assert max_parameter_gap(results, reference()) < TOLERANCE


@pytest.mark.ranks
def test_resumed_in_one_process_without_a_process_group(saved):
    finished = resume_in_one_process(str(saved[1]))
    assert max(((finished[n] - t).abs().max().item() for n, t in reference().items())) < TOLERANCE


@pytest.mark.ranks
def test_bytes_written_per_rank_are_the_ledger_share_of_weights_and_adam_state(saved):
    name, path, _ = saved
    layout, config = LAYOUTS[name], preset("tiny")
    mesh = Mesh(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"])
    written = checkpoint.written_bytes(str(path))
    assert set(written) == set(range(mesh.size))
    for stage in range(mesh.pp):
        for tp_rank in range(mesh.tp):
            ranks = [mesh.rank_of(pp=stage, dp=d, tp=tp_rank) for d in range(mesh.dp)]
            assert sum(written[r]["state"] for r in ranks) == checkpoint_bytes(config, mesh, stage, tp_rank)
    assert sum(w["state"] for w in written.values()) == 24 * count_params(config)   # the model, once
    assert all(w["file"] > w["state"] for w in written.values())


@pytest.mark.ranks
def test_a_checkpoint_with_other_data_is_refused(saved, tmp_path):
    layout = LAYOUTS["pp4"]
    with pytest.raises(Exception, match="is not this run's"):
        launch(save_and_resume, 4, layout=layout, steps=STEPS, root="", resume_from=str(saved[1]), batch_size=4)
