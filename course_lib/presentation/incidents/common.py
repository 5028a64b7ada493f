"""What the incidents share: the tiny model in float64 trained with SGD, its data, and the two tools that tell a
right parallel step from a wrong one."""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector

from ...comm import Comm
from ...data import SyntheticTokens
from ...model import build, loss_fn, preset

STEPS, BATCH_SIZE, SEQ_LEN = 3, 8, 16
LR = 0.5          # SGD's: large enough that a wrong gradient moves the weights by more than 1e-3 in three steps


def tiny(seed: int = 0, momentum: float = 0.0):
    """The tiny model in float64 (its weights from ``seed``), an SGD optimizer on it, and the course's data."""
    config = preset("tiny")
    model = build(config, seed=seed, dtype=torch.float64)
    return (model, torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum),
            SyntheticTokens(config.vocab_size, SEQ_LEN, seed=0))


def sgd_step(model, optimizer, inputs, targets, sync=None) -> float:
    """Forward, backward, ``sync(model)`` (the gradients' reduction, if any), update; the loss."""
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    if sync is not None:
        sync(model)
    optimizer.step()
    return loss.item()


def flat(model) -> torch.Tensor:
    """Every weight of ``model`` in one float64 vector (a copy)."""
    return parameters_to_vector([p.detach() for p in model.parameters()]).clone()


def flat_gradients(model) -> torch.Tensor:
    """Every gradient of ``model`` in one vector (a copy)."""
    return parameters_to_vector([p.grad for p in model.parameters()]).clone()


def reference(steps: int = STEPS, *, mask=None, sync=None, momentum: float = 0.0, prepare=None):
    """The oracle: one process trained on each step's whole batch (train.reference_run's run, with SGD), the same
    seed and data; ``mask(targets, step)`` edits the targets as the incident does, ``sync(model)`` acts on the
    gradients before each update (a clip), ``prepare(model)`` adds to the model what the incident adds (dropout).
    Returns the model."""
    model, optimizer, data = tiny(momentum=momentum)
    if prepare is not None:
        prepare(model)
    for step in range(steps):
        inputs, targets = data.batch(step, BATCH_SIZE)
        sgd_step(model, optimizer, inputs, mask(targets, step) if mask else targets, sync)
    return model


def gap(weights: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference between two weight vectors."""
    return (weights - expected).abs().max().item()


def checksums(model, comm: Comm, names=None) -> list[float]:
    """Every rank's sum of its weights (float64; only the parameters ``names``, if given), gathered: replicas
    that agree show one number."""
    held = [p.detach() for name, p in model.named_parameters() if names is None or name in names]
    mine = parameters_to_vector(held).sum().reshape(1)
    every = torch.empty(comm.size, dtype=torch.float64)
    comm.all_gather(every, mine)
    return every.tolist()


def average_gradients(model, comm: Comm) -> None:
    """Plain data parallelism: each gradient summed over the ranks and divided by their number (ddp.NaiveDDP's
    reduction without its constructor's broadcast, which would mend unsynced_init before it could show)."""
    for param in model.parameters():
        comm.all_reduce(param.grad)
        param.grad /= comm.size
