"""The checker of notebook 10's exercise (the global gradient norm over TP ranks); the package's __init__ wraps and
re-exports it, so notebooks call ``exercises.check_global_norm`` like the others."""

import math

import torch

from ...comm import Comm
from ...data import SyntheticTokens
from ...model import build, loss_fn, preset
from ...tensor_parallel import apply_tp
from .common import run_on_ranks

ATOL = 1e-12    # float64: the same squares summed in another order


def _gradients(tp_world: bool):
    """The tiny model's float64 gradients for one batch: split over the ranks' TP group, or whole (one process)."""
    config = preset("tiny")
    model = build(config, seed=0, dtype=torch.float64)
    if tp_world:
        apply_tp(model, Comm())
    inputs, targets = SyntheticTokens(config.vocab_size, 16, seed=0).batch(0, 4)
    loss_fn(model(inputs), targets).backward()
    return model


def check_global_norm(global_norm) -> bool:
    """10: ``global_norm(grads, is_split, tp_rank, comm)`` gets this rank's gradients ({name: tensor}) of the tiny
    model split over TP (apply_tp), ``is_split[name]`` (True: each tp rank holds a different slice; False: every
    tp rank holds the whole tensor, a norm weight, the embedding, the head), this rank's place in the TP group and
    its Comm, and must return the 2-norm of all the model's gradients, each element counted once, the same on
    every rank. Checked on 2 and 4 ranks (float64) against one process's torch.nn.utils.clip_grad_norm_."""
    whole = _gradients(tp_world=False)
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), math.inf).item()
    split_sq = sum(p.grad.double().pow(2).sum().item() for n, p in whole.named_parameters() if "_proj" in n)
    replicated_sq = expected ** 2 - split_sq

    def trial(rank, world_size):
        model = _gradients(tp_world=True)
        comm = Comm()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        is_split = {name: "_proj" in name for name in grads}        # the q/k/v/o and MLP projections
        with comm.trace() as log:
            norm = global_norm(grads, is_split, comm.rank, comm)
        value = norm.item() if isinstance(norm, torch.Tensor) and norm.numel() == 1 else norm
        return value, [record.op for record in log.records]

    for world_size in (2, 4):
        results = run_on_ranks(trial, world_size)
        if results is None:
            return False
        for rank, (value, ops) in enumerate(results):
            where = f"on {world_size} ranks, rank {rank}"
            if not isinstance(value, float):
                print(f"✗ {where}: return one number (a 0-d tensor or a float), not {type(value).__name__}")
                return False
            if not ops:
                print(f"✗ {where}: no traced collective: each rank holds only some of the gradients; sum the "
                      "squares here, then comm.all_reduce the sum")
                return False
            if abs(value - expected) <= ATOL:
                continue
            naive = math.sqrt(split_sq + world_size * replicated_sq)
            if abs(value - naive) <= ATOL:
                print(f"✗ {where}: {value:.6f}, but one process says {expected:.6f}: you counted the replicated "
                      f"gradients (norms, embedding, head) on all {world_size} ranks, {world_size} times. Count an "
                      "element whose is_split is False on tp rank 0 only")
                return False
            print(f"✗ {where}: {value:.6f}, but one process says {expected:.6f}. The 2-norm is sqrt(Σ g²): add "
                  "the squares (not the norms) on each rank, all-reduce that sum once, then take the square root")
            return False
    print(f"✓ correct: on 2 and 4 TP ranks every rank returns {expected:.6f}, one process's clip_grad_norm_ "
          f"(float64, to {ATOL:g}), each replicated gradient counted once")
    return True
