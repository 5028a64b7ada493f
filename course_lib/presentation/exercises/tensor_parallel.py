"""Notebook 04's exercise: the f of tensor parallelism (copy forward, all-reduce backward)."""

import torch

from ...comm import Comm
from .common import exercise, run_on_ranks


@exercise
def check_copy_to_tp_region(MyCopy) -> bool:
    """04: ``MyCopy`` must be Megatron's f as a torch.autograd.Function: ``MyCopy.apply(x, comm)`` returns x
    unchanged (no communication) and its backward all-reduces the gradient with ``comm.all_reduce`` (one
    call). Checked on 2 ranks in front of a column-parallel layer, against the dense layer's input gradient."""

    def trial(rank, world_size):
        torch.manual_seed(0)                              # the same x and dense W on every rank
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(4, 6, dtype=torch.float64)
        (x @ weight).sin().sum().backward()               # the dense layer's input gradient
        dense_grad = x.grad.clone()
        x.grad = None
        comm = Comm()
        columns = weight.chunk(world_size, dim=1)[rank]  # this rank's columns W_i
        with comm.trace() as forward:
            y = MyCopy.apply(x, comm)
        identity = isinstance(y, torch.Tensor) and torch.equal(y, x)
        with comm.trace() as backward:
            (y @ columns).sin().sum().backward()          # only this rank's share of dL/dx
        local_grad = (torch.cos(x.detach() @ columns) @ columns.T)
        return (identity, len(forward.records), len(backward.records), x.grad, dense_grad, local_grad)

    results = run_on_ranks(trial, 2, what="Function")
    if results is None:
        return False
    for rank, (identity, forward_count, backward_count, grad, dense_grad, local_grad) in enumerate(results):
        if not identity:
            print(f"✗ rank {rank}: forward must return x unchanged (f is the identity going forward)")
            return False
        if forward_count:
            print(f"✗ rank {rank}: your forward sent {forward_count} collective(s); f communicates only backward")
            return False
        if grad is not None and torch.allclose(grad, local_grad):
            print(f"✗ rank {rank}: the input gradient is only this rank's share X·W_i's part: dX = Σ_i dY_i·W_iᵀ "
                  "needs the other ranks' terms. All-reduce the gradient in backward")
            return False
        if backward_count != 1:
            print(f"✗ rank {rank}: backward made {backward_count} traced collectives; make exactly one, with "
                  "comm.all_reduce (dist.all_reduce is not traced)")
            return False
        if grad is None or not torch.allclose(grad, dense_grad, rtol=0, atol=1e-12):
            print(f"✗ rank {rank}: the input gradient differs from the dense layer's (sum, not mean; return "
                  "(grad, None): one value per input of forward)")
            return False
    print("✓ correct: identity forward, one all-reduce backward, and the input gradient equals the dense layer's")
    return True
