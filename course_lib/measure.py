"""Measure what training holds: every byte of state from tensor storage, every saved activation from autograd.

`measure_state_bytes` counts real tensor storage: parameters, their .grad, and every tensor in the
optimizer's state; a storage shared by two tensors (a tied weight, a view) is counted once. Meta tensors
(course_lib.virtual: a model of any size, no memory) count the bytes their storage would hold. torch's Adam
keeps a float32 `step` tensor per parameter tensor: those bytes grow with the number of tensors, not of
parameters, so they are reported apart as `step_counters`.

The formulas these measurements are checked against are in course_lib.ledger.
"""

from __future__ import annotations

import torch


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor that lives on this rank (a DTensor's local shard; any other tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor



def _storage_key(tensor: torch.Tensor):
    """(what names the tensor's storage, the storage's bytes). Views of one storage get one name. A meta
    tensor has a shape and dtype but no data: every meta storage's data pointer is 0, so the storage object
    itself names it there (its address, ``_cdata``); its nbytes() still holds numel × element size."""
    storage = _local(tensor).untyped_storage()
    name = storage._cdata if storage.device.type == "meta" else storage.data_ptr()
    return (str(storage.device), name), storage.nbytes()



def measure_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of training state this process holds, counted from tensor storage, each storage once.

    {"weights", "grads", "optimizer", "step_counters", "total"}: parameters; their .grad; the optimizer's
    per-element state (tensors with at least one dimension); its 0-dimensional state, such as the float32
    `step` torch's Adam keeps for every parameter tensor. Buffers are not training state and not counted
    (the course's model has none). Call it after a step: torch's optimizers make their state at step 1.
    """
    seen = set()
    state = {"weights": 0, "grads": 0, "optimizer": 0, "step_counters": 0}

    def add(part, tensor):
        key, nbytes = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            state[part] += nbytes

    params = list(model.parameters())
    for param in params:
        add("weights", param)
    for param in params:
        if param.grad is not None:
            add("grads", param.grad)
    # torch's ZeroRedundancyOptimizer keeps this rank's state in the optimizer it wraps, `.optim`.
    optimizer = getattr(optimizer, "optim", optimizer)
    if optimizer is not None:
        for param_state in optimizer.state.values():
            for value in param_state.values():
                if torch.is_tensor(value):
                    add("step_counters" if value.dim() == 0 else "optimizer", value)
    state["total"] = sum(state.values())
    return state



class SavedActivations:
    """Counts the bytes autograd saves for backward inside a `with` block, by module.

        with SavedActivations(model) as saved:
            loss = loss_fn(model(inputs), targets)
        saved.bytes, saved.by_module     # total, and {"layers.0.attn": ..., "loss": ...}

    Each storage is counted once, at the first module that saves it; parameters and views of parameters
    are left out. Use one forward per block: a storage freed by backward may be reused at the same address.
    Tensors saved outside any submodule (the loss) are filed under "loss".
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.bytes = 0
        self.by_module: dict[str, int] = {}
        self._excluded = {_storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self._seen = set()
        self._stack = ["loss"]
        self._handles = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor):
        key, nbytes = _storage_key(tensor)
        if nbytes and key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.bytes += nbytes
            self.by_module[self._stack[-1]] = self.by_module.get(self._stack[-1], 0) + nbytes
        return tensor       # keep the tensor itself: only counting, not changing what is saved

    def __enter__(self):
        def enter(name):
            def hook(module, args):
                self._stack.append(name)      # returns None: a hook that returns a value replaces the args
            return hook

        def leave(module, args, output):
            self._stack.pop()

        for name, module in self.model.named_modules():
            if name:   # the model itself is the outermost module: its own saves are the loss's, not a layer's
                self._handles.append(module.register_forward_pre_hook(enter(name)))
                self._handles.append(module.register_forward_hook(leave))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def by_kind(self) -> dict[str, int]:
        """by_module with the layer index dropped ("layers.3.attn" → "attn"), summed over layers."""
        kinds: dict[str, int] = {}
        for name, nbytes in self.by_module.items():
            parts = name.split(".", 2)
            if parts[0] == "layers":
                kind = parts[2] if len(parts) == 3 else "block"   # "layers.3" itself: saved by Block.forward
            else:
                kind = name
            kinds[kind] = kinds.get(kind, 0) + nbytes
        return kinds



def measure_step(model, optimizer, inputs, targets, loss_fn) -> dict:
    """Run one training step and measure it: {"activations": SavedActivations, "state": measure_state_bytes
    after the step (gradients still held), "cuda_peak": torch.cuda.max_memory_allocated during the step,
    or None off CUDA}."""
    on_cuda = inputs.is_cuda
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    optimizer.zero_grad()
    with SavedActivations(model) as saved:
        loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    cuda_peak = None
    if on_cuda:
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated()
    return {"activations": saved, "state": measure_state_bytes(model, optimizer), "cuda_peak": cuda_peak}


def memtracker_bytes(snapshot: dict, kind: str) -> int:
    """Bytes of one kind ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Total") in a snapshot of
    torch's MemTracker (torch.distributed._tools.mem_tracker), whose keys are enum members."""
    return next(nbytes for key, nbytes in snapshot.items() if getattr(key, "value", key) == kind)
