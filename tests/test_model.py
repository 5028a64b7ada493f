"""Tests for course_lib.model (the GPT, its presets and parameter counts) and course_lib.data."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.data import SyntheticTokens, shard
from course_lib.model import (
    GPT,
    PRESETS,
    ModelConfig,
    apply_rope,
    build,
    count_params,
    loss_fn,
    param_count_formula,
    preset,
    rms_norm,
)

# Published parameter counts of the real models (Qwen2 includes its q/k/v biases).
PUBLISHED_COUNTS = {
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "qwen2-7b": 7_615_616_512,
    "mixtral-8x7b": 46_702_792_704,   # 8 experts a layer, every one counted (12.9e9 of them active per token)
}


@pytest.fixture
def tiny():
    return preset("tiny")


@pytest.mark.parametrize("name", PUBLISHED_COUNTS)
def test_count_params_matches_published_models(name):
    assert count_params(preset(name)) == PUBLISHED_COUNTS[name]


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("tie", [False, True])
def test_formula_equals_count(name, tie):
    config = preset(name, tie_embeddings=tie)
    assert param_count_formula(config) == count_params(config)


def test_big_model_lives_on_meta_and_allocates_nothing():
    model = build(preset("llama2-70b"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    # Shapes still flow through forward, with no data anywhere (2 layers: meta ops are slow-ish in Python).
    model = build(preset("llama2-70b", num_layers=2), device="meta")
    logits = model(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    assert logits.shape == (1, 4, 32000) and logits.is_meta


def test_build_is_deterministic_from_seed_only(tiny):
    torch.manual_seed(1)
    a = build(tiny, seed=0)
    rng_state = torch.get_rng_state()
    torch.manual_seed(2)                       # a different global RNG must not matter
    b = build(tiny, seed=0)
    c = build(tiny, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    torch.manual_seed(1)
    build(tiny, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_state), "build must not consume the global RNG"


def test_init_values(tiny):
    model = build(tiny)
    assert torch.equal(model.norm.weight, torch.ones(tiny.hidden))
    assert abs(model.embed.weight.std().item() - 0.02) < 0.002
    assert model.layers[0].mlp.down_proj.weight.std() < model.layers[0].mlp.up_proj.weight.std()


def test_module_names_used_by_parallel_code(tiny):
    names = {name for name, _ in build(tiny, device="meta").named_parameters()}
    for part in ("attn_norm.weight", "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
                 "attn.o_proj.weight", "mlp_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"):
        assert f"layers.3.{part}" in names
    assert {"embed.weight", "norm.weight", "head.weight"} <= names


def test_forward_shape_and_loss_at_init(tiny):
    model = build(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, 17, tiny.vocab_size)
    # An untrained model is close to a uniform guess: loss ≈ ln(vocab_size).
    assert abs(loss_fn(logits, tokens).item() - math.log(tiny.vocab_size)) < 0.1
    with pytest.raises(ValueError, match="sequence length 65 > max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_causal_later_tokens_do_not_change_earlier_logits(tiny):
    model = build(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % tiny.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8], rtol=0, atol=0)
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_rope_depends_only_on_distance():
    q, k = torch.randn(1, 1, 1, 8).expand(1, 10, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 10, 1, 8)
    q, k = apply_rope(q, 10000.0)[0, :, 0], apply_rope(k, 10000.0)[0, :, 0]   # same vectors at 10 positions
    torch.testing.assert_close(q[5] @ k[2], q[7] @ k[4])                     # distance 3 both times
    torch.testing.assert_close(q.norm(dim=-1), q[:1].norm(dim=-1).expand(10))  # rotations keep length


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])   # multi-head, grouped-query, multi-query
def test_grouped_query_attention(tiny, kv_heads):
    config = preset("tiny", num_kv_heads=kv_heads)
    model = build(config)
    assert model.layers[0].attn.k_proj.weight.shape == (kv_heads * config.head_dim, config.hidden)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, config.vocab_size)


def test_attention_works_with_fewer_local_heads(tiny):
    """What tensor parallelism will do: keep the first half of the q/k/v heads (columns) and the
    matching half of o_proj's inputs (rows). Forward must run unchanged on the smaller layers."""
    attn = build(tiny).layers[0].attn
    half_q, half_kv = tiny.hidden // 2, tiny.num_kv_heads * tiny.head_dim // 2
    for proj, rows in ((attn.q_proj, half_q), (attn.k_proj, half_kv), (attn.v_proj, half_kv)):
        proj.weight = torch.nn.Parameter(proj.weight[:rows])
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight[:, :half_q])
    assert attn(torch.randn(2, 5, tiny.hidden)).shape == (2, 5, tiny.hidden)


def test_tied_embeddings_share_storage_and_count_once(tiny):
    config = preset("tiny", tie_embeddings=True)
    for device, dtype in ((None, None), ("meta", None), (None, torch.bfloat16)):
        model = build(config, device=device, dtype=dtype)
        assert model.head.weight is model.embed.weight
    assert count_params(config) == count_params(tiny) - tiny.vocab_size * tiny.hidden


def test_preset_overrides_and_unknown_names():
    assert preset("tiny", num_layers=12).num_layers == 12
    assert preset("tiny").num_layers == 4, "overrides must not change the stored preset"
    with pytest.raises(ValueError, match="known presets: tiny, llama2-7b"):
        preset("gpt5")


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=16, num_kv_heads=3), "num_heads=16 is not divisible by num_kv_heads=3"),
    (dict(hidden=60), "hidden=60 is not divisible by num_heads=8"),
    (dict(hidden=24, num_heads=8), "head_dim = hidden/num_heads = 24/8 = 3 is odd"),
    (dict(num_layers=0), "num_layers=0 must be a positive integer"),
    (dict(vocab_size=-5), "vocab_size=-5 must be a positive integer"),
    (dict(num_experts=4, top_k=5), "num_experts=4 must be a whole number >= 0 \\(0: a dense MLP\\) and top_k=5 a whole"),
    (dict(num_layers=True), "num_layers=True must be a positive integer"),
    (dict(num_experts=4.5), "num_experts=4.5 must be a whole number"),
    (dict(num_experts=4, top_k=1.5), "top_k=1.5 a whole number between 1 and num_experts"),
    (dict(rope_theta=float("nan")), "rope_theta=nan and norm_eps=1e-05 must both be finite and > 0"),
])
def test_config_errors_name_the_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **overrides)


def test_num_kv_heads_defaults_to_num_heads():
    config = ModelConfig(vocab_size=10, hidden=8, num_layers=1, num_heads=2, intermediate=16, max_seq_len=4)
    assert config.num_kv_heads == 2 and config.head_dim == 4


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny model gains nothing from more, and more threads on CI's two shared
    cores made these steps several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(steps, seed=0, lr=1e-2, batch_size=16, seq_len=32):
    config = preset("tiny")
    model: GPT = build(config, seed=seed)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs, targets = data.batch(step, batch_size)
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tiny_model_learns_the_synthetic_rule(one_thread):
    losses = train(steps=30)
    assert abs(losses[0] - math.log(128)) < 0.1            # starts at a uniform guess: ln 128 = 4.85
    assert sum(losses[-5:]) / 5 < 1.0                       # measured: 0.12 (the floor is 0)


def test_training_is_deterministic(one_thread):
    assert train(steps=3) == train(steps=3)


def test_data_is_deterministic_and_follows_the_rule():
    data = SyntheticTokens(vocab_size=128, seq_len=32, seed=0)
    inputs, targets = data.batch(step=7, batch_size=4)
    again, _ = SyntheticTokens(vocab_size=128, seq_len=32, seed=0).batch(step=7, batch_size=4)
    assert torch.equal(inputs, again)
    assert not torch.equal(inputs, data.batch(step=8, batch_size=4)[0])
    assert not torch.equal(inputs, SyntheticTokens(128, 32, seed=1).batch(step=7, batch_size=4)[0])
    assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])                  # targets = inputs shifted by one
    assert torch.equal(targets, torch.from_numpy(data.perm)[inputs])    # noise=0: next = perm[current]
    assert data.min_loss == 0.0


def test_noisy_data_min_loss():
    data = SyntheticTokens(vocab_size=128, seq_len=64, seed=0, noise=0.1)
    inputs, targets = data.batch(step=0, batch_size=256)
    follows_rule = (targets == torch.from_numpy(data.perm)[inputs]).float().mean().item()
    assert abs(follows_rule - (0.9 + 0.1 / 128)) < 0.01
    assert 0.7 < data.min_loss < 0.9                                     # 0.804 nats
    assert SyntheticTokens(128, 8, noise=1.0).min_loss == pytest.approx(math.log(128))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_rank_slices_are_disjoint_and_make_the_global_batch(world_size):
    data = SyntheticTokens(vocab_size=128, seq_len=16, seed=3)
    global_inputs, global_targets = data.batch(step=5, batch_size=16)
    slices = [data.rank_batch(step=5, global_batch_size=16, rank=r, world_size=world_size)
              for r in range(world_size)]
    assert all(inputs.shape == (16 // world_size, 16) for inputs, _ in slices)
    assert torch.equal(torch.cat([inputs for inputs, _ in slices]), global_inputs)
    assert torch.equal(torch.cat([targets for _, targets in slices]), global_targets)
    assert torch.equal(slices[0][0], global_inputs[:16 // world_size])    # rank 0 gets the first rows


def test_shard_errors_name_the_numbers():
    with pytest.raises(ValueError, match="global batch 10 is not divisible by world_size 4"):
        SyntheticTokens(128, 8).rank_batch(step=0, global_batch_size=10, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank=2 is outside 0..1"):
        shard(torch.zeros(4, 3), rank=2, world_size=2)


# ---- the fused-kernel RMSNorm -----------------------------------------------------------------------------

def test_fused_rms_norm_equals_torchs_in_float64_values_and_gradients():
    """model.FusedRMSNorm's hand-written forward and backward against F.rms_norm (autograd through its ops)
    and against finite differences (gradcheck)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, generator=generator, requires_grad=True)
    grad = torch.randn(3, 5, 16, dtype=torch.float64, generator=generator)
    ours = rms_norm(x, weight, 1e-5)
    theirs = F.rms_norm(x, (16,), weight, 1e-5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    for mine, torchs in zip(torch.autograd.grad(ours, (x, weight), grad),
                            torch.autograd.grad(theirs, (x, weight), grad)):
        torch.testing.assert_close(mine, torchs, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, weight))


def test_fused_rms_norm_saves_its_input_the_weight_and_one_fp32_rstd_per_token():
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, weight, 1e-5)
    assert [t.untyped_storage().data_ptr() for t in saved[:2]] == [x.untyped_storage().data_ptr(),
                                                                   weight.untyped_storage().data_ptr()]
    assert saved[2].dtype == torch.float32 and saved[2].shape == (2, 4, 1) and len(saved) == 3
