"""Activation checkpointing (激活重计算): keep less for backward, compute it again when backward needs it.

A forward keeps, for every operation, what its backward will read (course_lib.ledger counts it to the byte).
Checkpointing a function f drops everything f saves inside and keeps only f's inputs; when backward reaches f
it runs f's forward once more, on the kept inputs, and then its backward. Memory for compute:

    "full"        every block is checkpointed: a layer keeps its input, b·s·d·e bytes (b·s·d·e / t under
                  sequence parallelism: the block's input is this rank's s/t slice), instead of all its terms.
                  Backward reruns one block at a time, so the peak adds one layer's own terms. Extra compute:
                  one more forward of every block (cost.recompute_flops(terms, "full")).
    "selective"   only the attention core (GQA's repeat and SDPA, model.Attention.core) is checkpointed: it keeps
                  q, k, v, with k and v at their n_kv heads, and SDPA's log-sum-exp is recomputed. For GPT-3's
                  attention, which stores the s×s scores, this is Korthikanti et al.'s selective recomputation
                  (the 5·a·s/h term goes); SDPA already recomputes the scores in its backward, so here it saves
                  only the repeated k, v and the log-sum-exp. Extra compute: the core once more
                  (cost.recompute_flops(terms, "selective")).
    "op"          every block is checkpointed, and torch's selective checkpointing (create_selective_checkpoint_
                  contexts) keeps some outputs inside it: every matmul's but every second one's, and SDPA's
                  (EveryOtherMatmul, torchtitan's per-op policy). A layer keeps its input and the outputs of
                  q_proj, v_proj, SDPA (with its log-sum-exp), gate_proj and down_proj; backward reruns k_proj,
                  o_proj, up_proj and the cheap ops between (norms, rotary, SiLU, residual adds), never the
                  attention core. Extra compute: those three matmuls (cost.recompute_flops(terms, "op", config)).
                  torch holds the kept outputs in the checkpoint, where saved-tensor hooks do not see them:
                  kept_by_policy(model) counts them.

All run on torch.utils.checkpoint, non-reentrant (torch's recommended mode: it works with hooks, with inputs
that need no gradient, and stops recomputing as soon as backward has every tensor it saved, so a last matmul
whose output nobody saved, down_proj in a block or AV in the core, is not run again: tests/test_cost.py and
tests/test_recompute.py count it). preserve_rng_state=False: the course model draws no random numbers
(no dropout), and it lets the same code run on meta tensors (the virtual cluster).

It composes with every technique because it wraps a block's own forward (or its attention's core), inside the
module: the hooks that other techniques put on the block (sequence parallelism's scatter at the first layer and
gather at the last, apply_tp's f before attention and MLP) stay outside or are rerun exactly as they ran: under
TP a recomputed block runs its all-reduces again (Megatron-LM does the same). DDP, ZeRO and the pipeline
executor see ordinary modules. Apply it after apply_tp / apply_context_parallel / make_stage, before the
data-parallel wrapper; `checkpointed(model)` says what a model runs.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICIES = ("none", "selective", "op", "full")

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.linear.default)
# The attention kernels whose outputs "op" keeps: SDPA's fused backends (the CPU's flash kernel among them), and
# the batched matmuls of its math backend (torchtitan keeps every op of torch's compute-intensive list).
ATTENTION_KERNELS = (aten._scaled_dot_product_flash_attention.default,
                     aten._scaled_dot_product_flash_attention_for_cpu.default,
                     aten._scaled_dot_product_efficient_attention.default,
                     aten._scaled_dot_product_cudnn_attention.default, aten.bmm.default)


class EveryOtherMatmul:
    """The "op" policy for one forward of a block (torch's selective checkpointing, torch.utils.checkpoint.
    create_selective_checkpoint_contexts): keep the output of every matmul but every second one, and the attention
    kernel's; recompute everything else. torchtitan's per-op selective AC (torchtitan/distributed/
    activation_checkpoint.py, SelectiveAC: "recomputes every second matmul to balance memory and compute").

    In the course's block the matmuls run q, k, v, o, gate, up, down: q, v, gate and down are kept, k, o and up
    recomputed, with the norms, rotary, SiLU and the residual adds. ``cached``: storage -> bytes that this
    forward kept (torch holds them in the checkpoint, outside autograd's saved tensors)."""

    def __init__(self):
        self.matmuls = {False: 0, True: 0}        # counted apart in the forward and in its recomputation
        self.cached: dict = {}
        self.storages: dict = {}                  # storage -> a weak reference to it: is it still held?

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            self.matmuls[ctx.is_recompute] += 1
            keep = self.matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = func in ATTENTION_KERNELS
        if keep and not ctx.is_recompute:
            for tensor in torch.utils._pytree.tree_leaves(ctx.op_output):
                if torch.is_tensor(tensor):
                    key, nbytes = _storage(tensor)
                    self.cached[key] = nbytes
                    self.storages[key] = weakref.ref(tensor.untyped_storage())
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed:
    """Runs ``function`` under torch.utils.checkpoint (non-reentrant), with ``policy`` (a class such as
    EveryOtherMatmul, one instance per forward) choosing what to keep, or None to keep nothing but the inputs.
    While a :class:`RecomputeMeter` watches, each rerun in backward also reports the bytes it saves (module
    docstring of RecomputeMeter). ``cached``: what the last forward's policy kept (storage -> bytes)."""

    def __init__(self, function, policy=None):
        self.function, self.policy, self.meter, self.cached = function, policy, None, {}
        self._kept_by_this_forward = {}       # while a rerun runs: what its own forward's policy kept

    def __call__(self, *args):
        # The rerun runs inside the autograd engine, where the torch function modes of the forward (the virtual
        # cluster's MetaFlashAttention) are not active: enter them again, so the rerun computes as the forward did.
        modes = torch.overrides._get_current_function_mode_stack()
        policy = self.policy() if self.policy is not None else None
        kept = policy.storages if policy is not None else {}
        if policy is not None:
            self.cached = policy.cached

        @contextlib.contextmanager
        def rerun():
            # (under a pipeline, other micro-batches' forwards have run since: this rerun's forward kept ``kept``)
            self._kept_by_this_forward = kept
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                yield

        def contexts():
            if policy is None:
                return contextlib.nullcontext(), rerun()
            forward, recompute = create_selective_checkpoint_contexts(policy)
            return forward, _both(rerun(), recompute)

        return checkpoint(self._run, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts)

    def _run(self, *args):
        rerun = torch._C._current_graph_task_id() != -1      # called by the autograd engine: a recomputation
        if self.meter is None or not rerun:
            return self.function(*args)
        # The recomputation's own hook (checkpoint's) stores what the rerun saves; ours counts each tensor, then
        # hands it to that hook unchanged. torch has no public way to chain saved-tensor hooks, hence the
        # private getter of the innermost pair.
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        inputs = {_storage(a)[0] for a in args if torch.is_tensor(a)}
        kept = self._kept_by_this_forward
        counted: dict = {}

        def count_then_pack(tensor):
            key, nbytes = _storage(tensor)
            # What its forward kept is held already, while it lives: a kept output the rerun drops (down_proj's)
            # frees its memory, which a new tensor may then take, at the same address. So: alive now?
            held = key in kept and kept[key]() is not None
            if key not in inputs and key not in self.meter.excluded and not held:
                counted[key] = nbytes
            return pack(tensor)

        try:
            with torch.autograd.graph.saved_tensors_hooks(count_then_pack, unpack):
                return self.function(*args)
        finally:      # checkpoint stops a rerun early (by raising) once it has every tensor backward needs
            self.meter.reruns.append(sum(counted.values()))


@contextlib.contextmanager
def _both(first, second):
    """Enter ``first``, then ``second`` (both made, neither entered yet), when this is entered."""
    with first, second:
        yield


def _storage(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    name = storage._cdata if storage.device.type == "meta" else storage.data_ptr()
    return (str(storage.device), name), storage.nbytes()


class RecomputeMeter:
    """Counts what backward's recomputations save, each rerun apart: ``reruns`` (bytes per rerun, in order) and
    ``peak`` (the largest). A rerun's inputs are left out (the checkpoint already holds them: they are the
    forward's saved bytes), and so are what its forward's "op" policy kept, and parameters and their views, as
    measure.SavedActivations counts.

        with RecomputeMeter(model) as meter:
            loss.backward()
        meter.peak      # = ledger: one layer's terms less its input ("one layer, recomputed")
    """

    def __init__(self, model: nn.Module):
        self.wrappers = _wrappers(model)
        self.excluded = {_storage(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self.reruns: list[int] = []

    @property
    def peak(self) -> int:
        return max(self.reruns, default=0)

    def __enter__(self):
        for wrapper in self.wrappers:
            wrapper.meter = self
        return self

    def __exit__(self, *exc):
        for wrapper in self.wrappers:
            wrapper.meter = None


def _wrappers(model: nn.Module) -> list[_Checkpointed]:
    return [w for m in model.modules() for w in vars(m).values() if isinstance(w, _Checkpointed)]


def kept_by_policy(model: nn.Module) -> int:
    """Bytes that the last forward's "op" policies keep (EveryOtherMatmul.cached, over every checkpointed
    block): torch holds them in each checkpoint, where autograd's saved-tensor hooks (measure.SavedActivations)
    do not see them. 0 for the other policies."""
    return sum(sum(wrapper.cached.values()) for wrapper in _wrappers(model))


@contextlib.contextmanager
def kept_during(model: nn.Module):
    """What the "op" policies of ``model``'s blocks keep in the forwards run inside the block (yields a dict
    whose "bytes" is filled in at the end): the blocks that ran, not those of another micro-batch or chunk."""
    wrappers = _wrappers(model)
    before = [wrapper.cached for wrapper in wrappers]
    kept = {"bytes": 0}
    yield kept
    kept["bytes"] = sum(sum(w.cached.values()) for w, old in zip(wrappers, before) if w.cached is not old)


def apply_checkpointing(model: nn.Module, policy: str) -> nn.Module:
    """Checkpoint ``model``'s blocks ("full"; "op", keeping every second matmul's output) or each block's
    attention core ("selective"), in place; "none" changes nothing. Works on the whole model, a pipeline stage (its
    nn.Identity layers are skipped) or a ModuleList of stage chunks, after apply_tp (with or without SP) and
    apply_context_parallel ("selective" leaves ring attention as it is: its own Function keeps only q, k, v, its
    output and log-sum-exp, and rerunning it would rerun the ring). Returns the model; ``model.recompute`` records
    the policy."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: choose one of {', '.join(POLICIES)}")
    chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
    for chunk in chunks:
        if getattr(chunk, "recompute", "none") != "none":
            raise ValueError(f"this model is already checkpointed ({chunk.recompute!r}): apply_checkpointing once")
        for layer in chunk.layers:
            if isinstance(layer, nn.Identity):
                continue
            if policy == "full":
                layer.forward = _Checkpointed(layer.forward)   # an instance attribute: the module's hooks stay
            elif policy == "op":
                layer.forward = _Checkpointed(layer.forward, EveryOtherMatmul)
            elif policy == "selective" and hasattr(layer.attn, "core"):
                # (context parallelism's ring attention has no separate core: its Function keeps only q, k, v, its
                # output and log-sum-exp already, and rerunning it would rerun the ring: left as it is)
                layer.attn.core = _Checkpointed(layer.attn.core)
        chunk.recompute = policy
    return model


def checkpointed(model: nn.Module) -> str:
    """The policy ``model`` (or its first chunk) runs: one of POLICIES."""
    chunk = model[0] if isinstance(model, nn.ModuleList) else model
    return getattr(chunk, "recompute", "none")
