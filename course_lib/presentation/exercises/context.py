"""The checker of notebook 07's exercise (ring attention's log-sum-exp merge), kept apart so that exercises.py
stays short to read; exercises.py wraps and re-exports it, so notebooks call ``exercises.check_lse_merge`` like
the others.
"""

import torch
import torch.nn.functional as F

from ...comm import Comm
from ...context_parallel import ring_attention, shard_sequence
from .common import NOT_DONE, run_on_ranks

ATOL = 1e-9          # float64: the merge adds the same terms as one softmax, in another order (~1e-16 apart)
SHAPE = (2, 3, 5)    # batch, heads, queries: one log-sum-exp per query; out adds a head_dim of 4 (not 5, so
HEAD_DIM = 4         # that weights of shape [..., q] cannot broadcast against [..., q, d] by accident)
RING = dict(cp=4, batch=2, heads=4, seq_len=24, head_dim=8)


def _partial(scores, values):
    """Attention over one block of keys, normalised by the block's own sum: (out, lse)."""
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse[..., None]) @ values, lse


def _blocks(shift: float, seed: int):
    """Scores and values for 7 + 5 keys, block A's scores shifted by ``shift``; the whole attention too."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(*SHAPE, 12, generator=generator, dtype=torch.float64) * 3
    scores[..., :7] += shift
    values = torch.randn(*SHAPE[:2], 12, HEAD_DIM, generator=generator, dtype=torch.float64)
    whole = (torch.softmax(scores, dim=-1) @ values, scores.logsumexp(dim=-1))
    return _partial(scores[..., :7], values[..., :7, :]), _partial(scores[..., 7:], values[..., 7:, :]), whole


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=ATOL)


def _hint(out, lse, block_a, block_b, whole) -> str:
    """What a wrong (out, lse) most likely did."""
    (out_a, lse_a), (out_b, lse_b) = block_a, block_b
    if _close(out, whole[0]):
        return ("out is right but lse is not: the merged L is log(e^L_A + e^L_B), torch.logaddexp(lse_a, lse_b); "
                "the next ring step merges into it")
    if isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
        return ("inf or nan: e^L overflows once scores reach ~700 in float64. Weigh each block by "
                "exp(L_A - L) and exp(L_B - L), where L = logaddexp(L_A, L_B): exponents <= 0 never overflow")
    if _close(out, (out_a + out_b) / 2):
        return ("an average weighs the two blocks equally; block A's share of the softmax is "
                "e^L_A / (e^L_A + e^L_B) = exp(L_A - L)")
    if _close(out, torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b):
        return "each block's out is already normalised by e^L_A: weigh it by exp(L_A - L), not by exp(L_A)"
    return "out should be exp(L_A - L)·out_A + exp(L_B - L)·out_B with L = logaddexp(L_A, L_B)"


def check_lse_merge(lse_merge) -> bool:
    """07: ``lse_merge(out_a, lse_a, out_b, lse_b)`` gets the attention of the same queries over two disjoint
    blocks of keys, each normalised by its own sum (out: [..., queries, head_dim]; lse: [..., queries], the log
    of that sum), and must return (out, lse) over both blocks together, without changing its inputs. Checked in
    one process against the softmax over all the keys (float64; scores near 1000 too, where e^x overflows),
    then as ring attention's merge on 4 ranks (causal, load-balanced) against torch's attention on the whole
    sequence."""
    for shift, seed in ((0.0, 0), (1000.0, 1)):
        block_a, block_b, whole = _blocks(shift, seed)
        inputs = [t.clone() for t in (*block_a, *block_b)]
        try:
            answer = lse_merge(*inputs)
        except NotImplementedError:
            print(NOT_DONE)
            return False
        except Exception as error:        # any mistake in the learner's code is reported here, not raised
            print(f"Your function failed on blocks of shape out {tuple(block_a[0].shape)}, lse "
                  f"{tuple(block_a[1].shape)}: {type(error).__name__}: {error}")
            if "size of tensor" in str(error):
                print("  hint: lse holds one number per query, [..., q]; out [..., q, d]: lse[..., None] lines "
                      "them up")
            return False
        where = "scores near 1000" if shift else "ordinary scores"
        if not (isinstance(answer, tuple) and len(answer) == 2):
            print(f"✗ with {where}: return a pair (out, lse); got {type(answer).__name__}")
            return False
        if any(not torch.equal(a, b) for a, b in zip(inputs, (*block_a, *block_b))):
            print(f"✗ with {where}: your function changed its inputs in place; ring attention keeps merging "
                  "into them: compute new tensors")
            return False
        out, lse = answer
        if not (_close(out, whole[0]) and _close(lse, whole[1])):
            print(f"✗ with {where}: (out, lse) differ from the attention over both blocks\n  hint: "
                  + _hint(out, lse, block_a, block_b, whole))
            return False

    def trial(rank, world_size):
        from ... import context_parallel
        context_parallel._merge = lse_merge             # yours, in this rank's ring attention
        comm, generator = Comm(), torch.Generator().manual_seed(0)
        shape = (RING["batch"], RING["heads"], RING["seq_len"], RING["head_dim"])
        q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3))
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = ring_attention(*(shard_sequence(t, comm, 2) for t in (q, k, v)), comm, causal=True)
        return (out - shard_sequence(expected, comm, 2)).abs().max().item()

    gaps = run_on_ranks(trial, RING["cp"])
    if gaps is None:
        return False
    if max(gaps) > ATOL:
        print(f"✗ alone your merge is right, but as ring attention's merge on {RING['cp']} ranks the output is off "
              f"by {max(gaps):.1e}: does it work for any leading shape [batch, heads, queries]?")
        return False
    print(f"✓ correct: equal to the softmax over both blocks (float64, to {ATOL:g}), no overflow with scores near "
          f"1000, and as ring attention's merge on {RING['cp']} ranks (causal, load-balanced) equal to torch's "
          f"attention on the whole sequence (largest gap {max(gaps):.0e})")
    return True
