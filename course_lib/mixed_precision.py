"""An Adam for 16-bit models that keeps exactly the ledger's 12 bytes of optimizer state per parameter."""

from __future__ import annotations

import math

import torch


class MixedPrecisionAdam(torch.optim.Optimizer):
    """Adam for a model held in 16 bits, with exactly the 12 bytes of optimizer state per parameter of the
    16-byte rule: an fp32 master copy of every weight, and Adam's m and v in fp32.

    A step upcasts one 16-bit gradient at a time (a temporary), updates the fp32 master exactly as
    torch.optim.Adam (foreach=False) would, and rounds the result into the 16-bit weight. The step count
    is a Python int, so no per-tensor counters. State is made at construction: it exists before step 1.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if lr <= 0 or eps <= 0 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"lr={lr}, eps={eps} must be > 0 and betas={betas} in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        for group in self.param_groups:
            group["step"] = 0
            for param in group["params"]:
                self.state[param] = {
                    "master": param.detach().to(torch.float32, copy=True),   # a copy even if param is fp32
                    "exp_avg": torch.zeros_like(param, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros_like(param, dtype=torch.float32),
                }

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure: MixedPrecisionAdam does not re-evaluate the loss; call step() without one")
        for group in self.param_groups:
            group["step"] += 1
            beta1, beta2 = group["betas"]
            step_size = group["lr"] / (1 - beta1 ** group["step"])
            bias_correction2_sqrt = math.sqrt(1 - beta2 ** group["step"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                grad = param.grad.to(torch.float32)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["eps"])
                state["master"].addcdiv_(state["exp_avg"], denom, value=-step_size)
                param.copy_(state["master"])     # round the fp32 master into the 16-bit weight
