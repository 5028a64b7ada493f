"""The checker of notebook 08's exercise (expert parallelism), kept apart so that exercises.py stays short to
read; exercises.py wraps and re-exports it, so notebooks call ``exercises.check_expert_exchange`` like the others.
"""

import datetime
import json
import uuid
from collections import Counter

import torch
import torch.distributed as dist

from ...comm import Comm
from ...expert_parallel import apply_ep
from ...feed_forward import MoE, capacity
from ...model import preset
from .common import run_on_ranks

CONFIG = preset("tiny", num_experts=8, top_k=2)   # 8 SwiGLU experts of hidden 64: 4 per rank on 2, 2 on 4
TOKENS = (2, 8)                                    # per rank: 16 tokens, C = ceil(1.25 · 16 · 2 / 8) = 5 slots
CAPACITY_FACTOR = 1.25
ATOL = 1e-9    # float64: the same rows through the same experts, a few at a time or all at once (~1e-16)
RETURN_WAIT_SECONDS = 10.0   # ranks leave their last collective together: one still away this long never will
DIVERGED = "the ranks' collective calls diverge"


class CountedComm:
    """The ``comm`` the learner's exchange gets: a Comm whose collectives count their calls per op and publish
    the counts to the process group's store *before* each call runs. A rank that blocks in a collective the
    others never called thus still tells them how far it got (gloo would otherwise pair its call with their
    next one, and the hang would show up somewhere else)."""

    COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv",
                   "exchange", "barrier")

    def __init__(self, comm: Comm, store, prefix: str):
        self._comm, self._store, self._prefix = comm, store, prefix
        self.calls = Counter()
        store.set(f"{prefix}/calls/{comm.rank}", "{}")

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self.COLLECTIVES or not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            self._store.set(f"{self._prefix}/calls/{self._comm.rank}", json.dumps(self.calls))
            return attr(*args, **kwargs)
        return counted

    def returned(self) -> None:
        """Say this rank's exchange returned, and wait for every rank's: if one never returns, raise a
        RuntimeError naming each rank's calls per op and the ranks that had returned."""
        rank, size, store = self._comm.rank, self._comm.size, self._store
        store.set(f"{self._prefix}/returned/{rank}", json.dumps(self.calls))
        keys = [f"{self._prefix}/returned/{r}" for r in range(size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=RETURN_WAIT_SECONDS))
        except Exception:       # the store's timeout (DistStoreError): some rank is still inside the exchange
            back = [r for r in range(size) if store.check([keys[r]])]
            calls = {r: json.loads(store.get(f"{self._prefix}/calls/{r}")) for r in range(size)}
            away = [r for r in range(size) if r not in back]
            raise RuntimeError(
                f"{DIVERGED}. Calls per op on each rank: "
                + "; ".join(f"rank {r} {_calls_text(calls[r])}" for r in range(size))
                + f". Ranks {back} returned from your exchange; ranks {away} did not: each waits in a collective "
                "that not every rank called. Every rank must call the same collectives in the same order (is a "
                "call inside an `if` on the rank?)") from None


def _calls_text(calls: dict) -> str:
    return ", ".join(f"{op} × {n}" for op, n in sorted(calls.items())) or "no collective"


def check_expert_exchange(expert_exchange) -> bool:
    """08: ``expert_exchange(buffer, experts, comm)`` gets this rank's dispatch buffer [E, C, d] (buffer[i]: this
    rank's C slots for expert i) and this rank's E/ep experts (experts rank·E/ep, rank·E/ep + 1, ...), and must
    return [E, C, d]: expert i's output on every slot of buffer[i], whichever rank holds expert i, with one
    ``comm.all_to_all`` to dispatch and one to combine. Checked on 2 and 4 ranks (8 experts, float64) against
    every expert run in one process, then inside the MoE layer (``apply_ep``) against the whole layer."""
    num_experts, hidden = CONFIG.num_experts, CONFIG.hidden
    slots = capacity(TOKENS[0] * TOKENS[1], num_experts, CONFIG.top_k, CAPACITY_FACTOR)
    buffer_bytes = num_experts * slots * hidden * 8
    prefix = f"check_expert_exchange/{uuid.uuid4().hex}"    # this check's keys in the store, and no other's

    def trial(rank, world_size):
        torch.manual_seed(0)                                    # the same whole layer on every rank
        whole = MoE(CONFIG, capacity_factor=CAPACITY_FACTOR).double()
        generator = torch.Generator().manual_seed(100 + rank)   # each rank its own tokens
        buffer = torch.randn(num_experts, slots, hidden, dtype=torch.float64, generator=generator)
        x = torch.randn(*TOKENS, hidden, dtype=torch.float64, generator=generator)
        mine = num_experts // world_size
        comm = Comm()
        counted = CountedComm(comm, dist.distributed_c10d._get_default_store(), f"{prefix}/{world_size}")
        with torch.no_grad():
            expected = torch.stack([expert(rows) for expert, rows in zip(whole.experts, buffer)])
            with comm.trace() as log:
                out = expert_exchange(buffer.clone(), whole.experts[rank * mine:(rank + 1) * mine], counted)
            counted.returned()        # before any further collective: a rank left behind is named here
            ops = [(record.op, record.payload_bytes) for record in log.records]
            if not (isinstance(out, torch.Tensor) and out.shape == expected.shape):
                return out, expected, ops, None
            torch.manual_seed(0)
            layer = apply_ep(MoE(CONFIG, capacity_factor=CAPACITY_FACTOR).double(), comm)
            layer._run_experts = lambda buffer: expert_exchange(buffer, layer.experts, comm)   # yours, in the layer
            layer_gap = (layer(x) - whole(x)).abs().max().item()
        return out, expected, ops, layer_gap

    for world_size in (2, 4):
        results = run_on_ranks(trial, world_size, explain=_explain_divergence)
        if results is None:
            return False
        for rank, (out, expected, ops, layer_gap) in enumerate(results):
            where = f"on {world_size} ranks, rank {rank}"
            mistake = (_collective_mistake(where, rank, num_experts // world_size, ops, buffer_bytes)
                       or _output_mistake(where, out, expected, layer_gap))
            if mistake:
                print(mistake)
                return False
    print(f"✓ correct: on 2 and 4 ranks, 2 all-to-alls of {buffer_bytes:,} bytes each (dispatch, combine), every "
          f"expert's output equal to one process's, and the EP layer with your exchange equal to the whole layer "
          f"(float64, to {ATOL:g})")
    return True


def _explain_divergence(summary: str) -> str | None:
    """The failure message for ranks whose collectives diverged (CountedComm.returned's words), else None."""
    return "✗ " + summary[summary.index(DIVERGED):] if DIVERGED in summary else None


def _collective_mistake(where: str, rank: int, mine: int, ops: list, buffer_bytes: int) -> str | None:
    """What is wrong with the collectives one rank traced (``ops``: (op, payload bytes) pairs), or None if they
    are the two all-to-alls of the whole buffer, E·C·d·8 bytes each. ``mine``: the experts per rank."""
    names = [op for op, _ in ops]
    if not ops:
        return (f"✗ {where}: no traced collective. Rank {rank} holds experts {rank * mine}–"
                f"{(rank + 1) * mine - 1} only; the slots for the others must travel to their ranks: "
                "comm.all_to_all(output, input)")
    if any(name != "all_to_all" for name in names):
        return f"✗ {where}: traced {names}; use comm.all_to_all, once to dispatch and once to combine"
    if len(ops) == 1:
        return (f"✗ {where}: one all-to-all. After it the outputs sit on the experts' ranks; a second "
                "all_to_all (the combine) sends them back to the ranks whose tokens they are")
    if len(ops) > 2:
        return f"✗ {where}: {len(ops)} all-to-alls; one to dispatch and one to combine are enough"
    if any(payload != buffer_bytes for _, payload in ops):
        return (f"✗ {where}: each all-to-all should carry the whole [E, C, d] buffer ({buffer_bytes:,} bytes); "
                f"yours carried {[payload for _, payload in ops]}")
    return None


def _output_mistake(where: str, out, expected: torch.Tensor, layer_gap: float | None) -> str | None:
    """What is wrong with one rank's output ``out`` (vs. every expert run in one process, ``expected``) and with
    the EP layer built on the exchange (``layer_gap``: its largest difference from the whole layer), or None."""
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"✗ {where}: expected a tensor of the buffer's shape {tuple(expected.shape)}, got {got}"
    wrong = [i for i in range(expected.shape[0]) if not torch.allclose(out[i], expected[i], rtol=0, atol=ATOL)]
    if wrong:
        return (f"✗ {where}: the outputs for experts {wrong} are not those experts' outputs on your slots. "
                f"Chunk j of what the dispatch returns comes from rank j and holds its slots for YOUR "
                f"experts: view it as [ep, E/ep, C, d], run your expert i on [:, i], and keep that layout "
                "for the combine")
    if layer_gap is None or layer_gap > ATOL:
        return (f"✗ {where}: in the MoE layer your exchange gives outputs off by {layer_gap:.1e} from the "
                "whole layer in one process (did it change the buffer it was given?)")
    return None
