"""The single-process training loop: the reference every parallel version is checked against.

One training step is four moves (the same four in every notebook, however the work is split):

    1. forward   logits = model(inputs)                  the model's prediction for every next token
    2. loss      loss = cross_entropy(logits, targets)   one number: how wrong the prediction was
    3. backward  loss.backward()                         gradient dL/dw for every parameter w
    4. update    w ← w - lr · (step computed from dL/dw)  the optimizer moves every w against its gradient

With plain SGD the update is exactly ``w_new = w - lr * grad``; Adam, used here, divides by a running
estimate of the gradient's size so every parameter moves by roughly ``lr`` per step.
"""

import torch

from .data import SyntheticTokens
from .model import GPT, build, loss_fn, preset


def training_step(model: GPT, optimizer: torch.optim.Optimizer, inputs, targets) -> float:
    """Run the four moves once; return the loss before the update."""
    logits = model(inputs)              # 1. forward
    loss = loss_fn(logits, targets)     # 2. loss
    optimizer.zero_grad()
    loss.backward()                     # 3. backward: fills param.grad for every parameter
    optimizer.step()                    # 4. update
    return loss.item()


def train(model: GPT, data: SyntheticTokens, *, steps: int, lr: float, batch_size: int) -> list[float]:
    """Train with Adam on ``data`` for ``steps`` steps; return the loss of every step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return [training_step(model, optimizer, *data.batch(step, batch_size)) for step in range(steps)]


OPTIMIZERS = {"adam": lambda params, lr: torch.optim.Adam(params, lr=lr, foreach=False),
              "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr)}


def reference_run(config=None, *, steps: int, batch_size: int, lr: float, optimizer: str = "adam", seq_len: int = 32,
                dtype=None, seed: int = 0) -> tuple[list[float], GPT]:
    """The reference every parallel run is checked against: ``config`` (default: the tiny model) trained in one
    process on each step's whole global batch, with the same data and seed as the ranks. Returns the loss of
    every step and the trained model."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    config = config or preset("tiny")
    model = build(config, seed=seed, dtype=dtype)
    update = OPTIMIZERS[optimizer](model.parameters(), lr)
    data = SyntheticTokens(config.vocab_size, seq_len, seed=seed)
    return [training_step(model, update, *data.batch(step, batch_size)) for step in range(steps)], model


def tiny_loss_curve(lr: float, steps: int = 40, batch_size: int = 16, seq_len: int = 32, seed: int = 0):
    """The loss curve of the tiny model on the synthetic data: deterministic in its arguments."""
    config = preset("tiny")
    model = build(config, seed=seed)
    return train(model, SyntheticTokens(config.vocab_size, seq_len, seed=seed),
                 steps=steps, lr=lr, batch_size=batch_size)
