"""The mixture-of-experts explorer (notebook 08): top-k, capacity factor, EP ranks and how alike the tokens are →
the load on every expert and every EP rank, the assignments dropped, the load-balancing loss and the bytes of one
all-to-all. Each redraw runs the real layer (course_lib.expert_parallel.MoE) on 256 tokens: instant.

"Tokens" means what it means in notebook 08's part 4: the 256 tokens are the EP group's, and each of the ep ranks
holds and routes its own 256/ep of them, with C = ceil(factor × (256/ep) × k / E) slots per expert for its
tokens. An expert then computes ep·C rows, C from each rank; what one rank sends in one all-to-all is
expert_parallel.all_to_all_bytes(256/ep, ...)."""

import dataclasses

import ipywidgets as widgets
import torch

from ...expert_parallel import all_to_all_bytes
from ...feed_forward import MoE, Routing
from ...model import preset
from .. import plots
from ._panel import ExplorerPanel, format_bytes, plural

NUM_EXPERTS, NUM_TOKENS = 8, 256
TOP_KS = (1, 2, 4)
CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
EP_RANKS = (1, 2, 4, 8)
SKEWS = (0.0, 0.25, 0.5, 1.0)


def alike_tokens(num_tokens: int, hidden: int, skew: float, seed: int = 1) -> torch.Tensor:
    """[num_tokens, hidden] tokens that are ``skew`` alike: each is its own random vector z (length ≈ √hidden)
    plus skew·√hidden times one unit direction u that all share. A router scores a token by W_r·x = W_r·z +
    skew·√hidden·W_r·u: the shared part adds the same amount to every token's score for each expert, so the
    more alike the tokens, the more of them pick the same experts (as real text does: common words, positions)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(hidden, generator=generator)
    shared = shared / shared.norm()
    return torch.randn(num_tokens, hidden, generator=generator) + skew * hidden**0.5 * shared


def moe_explorer(top_k=2, capacity_factor=1.25, ep=4, skew=0.5):
    """Top-k × capacity factor × EP ranks × how alike the tokens are → tokens per expert and per EP rank, drops.

    The layer is the tiny model's MoE with 8 experts (seed 0), run on 256 tokens (:func:`alike_tokens`), the EP
    group's: each of the ep ranks routes its 256/ep (the module docstring). The router's choices do not depend
    on ep (each token is scored alone); the capacity, and so the drops, are per rank's tokens.
    ``panel.rank_routings`` (each rank's Routing), ``panel.routing`` (their total: the group's load, capacity
    ep·C), ``panel.aux_loss`` (over all 256 tokens) and ``panel.wire_bytes`` (one all-to-all, bytes each rank
    sends, float32), as shown.
    """
    config = preset("tiny", num_experts=NUM_EXPERTS, top_k=top_k)
    torch.manual_seed(0)
    moe = MoE(config, capacity_factor=capacity_factor)
    tokens = {}                       # skew → its tokens, made once
    controls = _moe_controls(top_k, capacity_factor, ep, skew)
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls["top_k"], controls["ep"]]),
                                         widgets.VBox([controls["capacity_factor"], controls["skew"]])])],
                          controls, "the tokens each expert and each EP rank receives, and the ones dropped, for a "
                                    "top-k, capacity factor and number of EP ranks of your choice")

    def show(chosen):
        k, factor, ranks, alike = chosen["top_k"], chosen["capacity_factor"], chosen["ep"], chosen["skew"]
        if alike not in tokens:
            tokens[alike] = alike_tokens(NUM_TOKENS, config.hidden, alike)
        moe.top_k, moe.capacity_factor = k, factor          # the same layer: only the routing rules change
        per_rank_tokens = NUM_TOKENS // ranks
        panel.rank_routings = []
        with torch.no_grad():
            for r in range(ranks):                           # each rank routes its own tokens, as in part 4
                moe(tokens[alike][r * per_rank_tokens:(r + 1) * per_rank_tokens])
                panel.rank_routings.append(dataclasses.replace(moe.last_routing, ep=ranks))
            moe(tokens[alike])                               # the group's load-balancing loss, all 256 tokens
        panel.routing = routing = Routing.total(panel.rank_routings)
        panel.aux_loss = moe.aux_loss.item()
        panel.wire_bytes = all_to_all_bytes(per_rank_tokens, config.hidden, NUM_EXPERTS, k, factor, ranks)
        assignments = NUM_TOKENS * k
        panel.draw(plots.expert_load(routing, title=f"top-{k}, capacity factor {factor:g}, tokens alike {alike:g}: "
                                                    f"{routing.dropped:,} of {assignments:,} assignments dropped"))
        _print_moe_summary(panel, k, factor, ranks)

    panel.redraw_on_change(show)
    return panel


def _moe_controls(top_k, capacity_factor, ep, skew) -> dict:
    """The explorer's four controls, by the name of the argument each one sets, starting at its value."""
    return {
        "top_k": widgets.ToggleButtons(options=list(TOP_KS), value=top_k, description="top-k"),
        "capacity_factor": widgets.SelectionSlider(options=list(CAPACITY_FACTORS), value=capacity_factor,
                                                   description="capacity factor"),
        "ep": widgets.ToggleButtons(options=list(EP_RANKS), value=ep, description="EP ranks"),
        "skew": widgets.SelectionSlider(options=list(SKEWS), value=skew, description="tokens alike"),
    }


def _print_moe_summary(panel, k: int, factor: float, ranks: int) -> None:
    """Print what the panel's latest routing shows: the capacity C = ceil(factor × (256/ep) × k / E), the drops,
    the busiest expert's share, the load-balancing loss and the all-to-all's bytes per rank."""
    routing, per_rank_tokens = panel.routing, NUM_TOKENS // ranks
    slots = panel.rank_routings[0].capacity
    busiest = max(r.imbalance for r in panel.rank_routings)
    assignments = NUM_TOKENS * k
    per_rank = routing.tokens_per_rank
    print(f"{NUM_TOKENS} tokens in the EP group, {per_rank_tokens} on each of its {plural(ranks, 'rank')}; top-{k} "
          f"of {NUM_EXPERTS} experts: C = ceil({factor:g} × {per_rank_tokens} × {k} / {NUM_EXPERTS}) = {slots} "
          f"slots per expert for each rank's tokens, {routing.capacity} per expert over the group")
    print(f"dropped {routing.dropped:,} of {assignments:,} assignments ({routing.dropped / assignments:.1%}); "
          f"on the busiest rank the busiest expert is asked for {busiest:.2f}× its even share (a capacity "
          f"factor of {busiest:.2f} or more drops nothing)")
    print(f"load-balancing loss {panel.aux_loss:.3f} (1.0 = even)", end="")
    if ranks == 1:
        print("; one rank holds every expert: no all-to-all")
    else:
        print(f"; on {plural(ranks, 'EP rank')} the busiest computes {max(per_rank) * ranks / sum(per_rank):.2f}× "
              f"the mean, and each all-to-all sends {format_bytes(panel.wire_bytes)} per rank, fixed by C")

