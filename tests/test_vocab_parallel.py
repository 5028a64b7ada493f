"""The split vocabulary: embedding, head and cross-entropy over the TP group against one process in float64 (loss,
logits' slices, every gradient), the traced all-reduces against vocab_parallel_traffic, the saved bytes against
the formula (the loss's divide by t), the weights each rank holds, and clear errors."""

import pytest
import torch

from course_lib import launch
from course_lib.comm import Comm
from course_lib.data import SyntheticTokens
from course_lib.ledger import gpt_activation_bytes
from course_lib.measure import SavedActivations
from course_lib.model import build, count_params, loss_fn, preset
from course_lib.tensor_parallel import apply_tp, tp_step_traffic
from course_lib.vocab_parallel import (
    vocab_parallel_activation_bytes,
    vocab_parallel_cross_entropy,
    vocab_parallel_traffic,
)

pytestmark = pytest.mark.ranks
F64 = dict(rtol=0, atol=1e-12)
BATCH, SEQ = 4, 16


def whole_and_split(rank, world_size, sequence_parallel=False):
    torch.set_num_threads(1)
    config, comm = preset("tiny"), Comm()
    inputs, targets = SyntheticTokens(config.vocab_size, SEQ, seed=0).batch(0, BATCH)
    whole = build(config, dtype=torch.float64)
    logits = whole(inputs)
    loss = loss_fn(logits, targets)
    loss.backward()
    split = apply_tp(build(config, dtype=torch.float64), comm, sequence_parallel=sequence_parallel,
                     vocab_parallel=True)
    with comm.trace() as forward:
        split_logits = split(inputs)
        split_loss = split.loss_fn(split_logits, targets)
    with comm.trace() as backward:
        split_loss.backward()
    # the loss alone, on the whole model's logits' slice: what its Function sends and saves
    mine = logits.detach().chunk(world_size, dim=-1)[rank].float().requires_grad_()
    with SavedActivations(torch.nn.Module()) as saved, comm.trace() as loss_trace:
        vocab_parallel_cross_entropy(mine, targets, comm)
    return {
        "gaps": {"loss": abs(split_loss.item() - loss.item()),
                 "logits": (split_logits - logits.chunk(world_size, dim=-1)[rank]).abs().max().item(),
                 "embed": (split.embed.weight.grad - whole.embed.weight.grad.chunk(world_size)[rank]).abs().max().item(),
                 "head": (split.head.weight.grad - whole.head.weight.grad.chunk(world_size)[rank]).abs().max().item(),
                 "norm": (split.norm.weight.grad - whole.norm.weight.grad).abs().max().item()},
        "forward": forward.summary(), "backward": backward.summary(), "loss_saved": saved.bytes,
        "loss_ops": {op: t.count for op, t in loss_trace.summary().items()},
        "loss_wire": loss_trace.wire_bytes, "params": sum(p.numel() for p in split.parameters()),
        "wire": forward.wire_bytes + backward.wire_bytes,
    }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["TP", "TP+SP"])
@pytest.mark.parametrize("tp", [2, 4])
def test_split_vocabulary_matches_one_process(tp, sequence_parallel):
    config = preset("tiny")
    results = launch(whole_and_split, tp, sequence_parallel=sequence_parallel)
    for r in results:
        for what, gap in r["gaps"].items():
            assert gap <= F64["atol"], f"tp={tp}: {what} differs by {gap}"
    # traced: the layers' bytes, plus the lookup's and the loss's all-reduces forward and the head's backward
    layers = tp_step_traffic(config, BATCH, SEQ, tp, 8, sequence_parallel)["wire_bytes_per_rank"]
    vocab = vocab_parallel_traffic(BATCH, SEQ, config.hidden, 8, tp)["wire_bytes_per_rank"]
    assert results[0]["wire"] == pytest.approx(layers + vocab, rel=1e-12)
    # each rank holds 1/tp of the layers' matrices and V/tp rows of the embedding and of the head
    vocab_tables = 2 * config.vocab_size * config.hidden
    assert results[0]["params"] == count_params(config) - _layer_split(config, tp) - vocab_tables + vocab_tables // tp


def _layer_split(config, tp):
    d, hd = config.hidden, config.head_dim
    matrices = config.num_layers * (2 * d * config.num_heads * hd + 2 * d * config.num_kv_heads * hd
                                    + 3 * d * config.intermediate)
    return matrices - matrices // tp


@pytest.mark.parametrize("tp", [2, 4])
def test_the_loss_saves_one_tpth_of_the_log_probabilities_and_sends_three_numbers_per_token(tp):
    results = launch(whole_and_split, tp)
    tokens, vocab = BATCH * SEQ, preset("tiny").vocab_size
    for r in results:
        assert r["loss_ops"] == {"all_reduce": 3}
        assert r["loss_wire"] == pytest.approx(3 * 2 * (tp - 1) / tp * tokens * 4, rel=1e-12)
        assert r["loss_saved"] == vocab_parallel_activation_bytes(BATCH, SEQ, vocab, tp)["loss"]
    unsplit = gpt_activation_bytes(preset("tiny"), BATCH, SEQ)["loss"]
    assert unsplit == tokens * vocab * 4 + tokens * 8 + 4
    assert vocab_parallel_activation_bytes(BATCH, SEQ, vocab, tp)["loss"] == tokens * vocab * 4 // tp + tokens * 9


def saved_embed(rank, world_size):
    config, comm = preset("tiny"), Comm()
    model = apply_tp(build(config), comm, vocab_parallel=True)
    inputs, targets = SyntheticTokens(config.vocab_size, SEQ, seed=0).batch(0, BATCH)
    with SavedActivations(model) as saved:
        model.loss_fn(model(inputs), targets)
    return saved.by_module


def test_the_split_embedding_saves_its_local_ids_and_mask():
    by_module = launch(saved_embed, 2)[0]
    assert by_module["embed"] == vocab_parallel_activation_bytes(BATCH, SEQ, 128, 2)["embed"] == BATCH * SEQ * 9


def refused(rank, world_size, overrides):
    model = build(preset("tiny", **overrides))
    apply_tp(model, Comm(), vocab_parallel=True)


@pytest.mark.parametrize("overrides,message", [
    ({"vocab_size": 127}, r"vocab_size=127 cannot split over TP=2"),
    ({"tie_embeddings": True}, r"vocab_parallel with tie_embeddings=True"),
])
def test_clear_errors(overrides, message):
    from course_lib import RankError
    with pytest.raises(RankError, match=message):
        launch(refused, 2, overrides=overrides)
