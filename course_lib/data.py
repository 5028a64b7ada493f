"""A synthetic token stream with a hidden rule, so that the loss visibly falls within a few dozen steps.

The rule: a fixed random permutation `perm` of the vocabulary (drawn from `seed`). Each sequence starts at a
uniformly random token, and every next token is

    next = perm[current]          with probability 1 - noise
    next = a uniform random token with probability noise

The best possible model predicts perm[current] with probability 1 - noise + noise/V and every other token
with noise/V, so the lowest achievable mean cross entropy (nats per token) is the entropy of that guess:

    min_loss = -(1 - noise + noise/V)·ln(1 - noise + noise/V) - (V - 1)·(noise/V)·ln(noise/V)

which is 0 for noise = 0. An untrained model guesses uniformly: loss ≈ ln V (4.85 for V = 128).

Data parallelism: every rank builds the same global batch for a step and keeps its own contiguous slice
of rows (rank r of W gets rows [r·B/W, (r+1)·B/W)), so the slices are disjoint and, concatenated in rank
order, give back exactly the global batch.
"""

import math

import numpy as np
import torch

# Tags that keep the two random streams (the rule, and each step's batch) apart for the same seed.
_RULE, _BATCH = 0, 1


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the rows of `batch` (rank 0 gets the first rows)."""
    rows = batch.shape[0]
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1} for world_size={world_size}")
    if rows % world_size:
        raise ValueError(f"global batch {rows} is not divisible by world_size {world_size}: "
                         "every rank must get the same number of rows")
    per_rank = rows // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, noise: float = 0.0):
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2 and seq_len={seq_len} >= 1")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise} is a probability: it must lie in [0, 1]")
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise
        self.perm = np.random.default_rng([seed, _RULE]).permutation(vocab_size)

    @property
    def min_loss(self) -> float:
        """Entropy of the next token given the current one (nats): no model can do better on average."""
        p_rule = 1 - self.noise + self.noise / self.vocab_size
        p_other = self.noise / self.vocab_size
        loss = p_rule * math.log(1 / p_rule)   # entropy: sum of p·ln(1/p) over the possible next tokens
        if p_other > 0:
            loss += (self.vocab_size - 1) * p_other * math.log(1 / p_other)
        return loss

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both LongTensor[batch_size, seq_len]; targets are inputs shifted by one.
        Depends only on (seed, step): any process asking for the same step gets the same batch."""
        rng = np.random.default_rng([self.seed, _BATCH, step])
        tokens = np.empty((batch_size, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(self.vocab_size, size=batch_size)
        random_tokens = rng.integers(self.vocab_size, size=(batch_size, self.seq_len))
        is_noise = rng.random((batch_size, self.seq_len)) < self.noise
        for t in range(self.seq_len):
            tokens[:, t + 1] = np.where(is_noise[:, t], random_tokens[:, t], self.perm[tokens[:, t]])
        tokens = torch.from_numpy(tokens)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def rank_batch(self, step: int, global_batch_size: int, rank: int,
                   world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s share of the global batch of `step`: global_batch_size // world_size rows."""
        inputs, targets = self.batch(step, global_batch_size)
        return shard(inputs, rank, world_size), shard(targets, rank, world_size)


def micro_batches(data, step: int, micro_batch_size: int, rank: int, world_size: int,
                  accumulation_steps: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of step ``step``: the global batch (micro_batch_size × world_size ×
    accumulation_steps rows) cut into accumulation_steps micro-batches, each sharded over the ranks."""
    inputs, targets = data.batch(step, micro_batch_size * world_size * accumulation_steps)
    return [(shard(i, rank, world_size), shard(t, rank, world_size))
            for i, t in zip(inputs.chunk(accumulation_steps), targets.chunk(accumulation_steps))]
