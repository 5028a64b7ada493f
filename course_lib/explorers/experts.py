"""The mixture-of-experts explorer (notebook 08): top-k, capacity factor, EP ranks and how alike the tokens are →
the load on every expert and every EP rank, the assignments dropped, the load-balancing loss and the bytes of one
all-to-all. Each redraw runs the real layer (course_lib.experts.MoE) on 256 tokens: instant."""

import dataclasses

import ipywidgets as widgets
import torch

from .. import plots
from ..experts import all_to_all_bytes
from ..model import preset
from ..moe import MoE
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

    The layer is the tiny model's MoE with 8 experts (seed 0), run on 256 tokens (:func:`alike_tokens`). The
    routing does not depend on ep (the router sees the same tokens): ep only groups the experts onto ranks.
    ``panel.routing`` (a Routing, with ep set), ``panel.aux_loss`` and ``panel.wire_bytes`` (one all-to-all,
    bytes each rank sends, float32), as shown.
    """
    config = preset("tiny", num_experts=NUM_EXPERTS, top_k=top_k)
    torch.manual_seed(0)
    moe = MoE(config, capacity_factor=capacity_factor)
    tokens = {}                       # skew → its tokens, made once
    controls = {
        "top_k": widgets.ToggleButtons(options=list(TOP_KS), value=top_k, description="top-k"),
        "capacity_factor": widgets.SelectionSlider(options=list(CAPACITY_FACTORS), value=capacity_factor,
                                                   description="capacity factor"),
        "ep": widgets.ToggleButtons(options=list(EP_RANKS), value=ep, description="EP ranks"),
        "skew": widgets.SelectionSlider(options=list(SKEWS), value=skew, description="tokens alike"),
    }
    panel = ExplorerPanel([widgets.HBox([widgets.VBox([controls["top_k"], controls["ep"]]),
                                         widgets.VBox([controls["capacity_factor"], controls["skew"]])])],
                          controls, "the tokens each expert and each EP rank receives, and the ones dropped, for a "
                                    "top-k, capacity factor and number of EP ranks of your choice")

    def show(chosen):
        k, factor, ranks, alike = chosen["top_k"], chosen["capacity_factor"], chosen["ep"], chosen["skew"]
        if alike not in tokens:
            tokens[alike] = alike_tokens(NUM_TOKENS, config.hidden, alike)
        moe.top_k, moe.capacity_factor = k, factor          # the same layer: only the routing rules change
        with torch.no_grad():
            moe(tokens[alike])
        panel.routing = routing = dataclasses.replace(moe.last_routing, ep=ranks)
        panel.aux_loss = moe.aux_loss.item()
        panel.wire_bytes = all_to_all_bytes(NUM_TOKENS, config.hidden, NUM_EXPERTS, k, factor, ranks)
        assignments = NUM_TOKENS * k
        panel.draw(plots.expert_load(routing, title=f"top-{k}, capacity factor {factor:g}, tokens alike {alike:g}: "
                                                    f"{routing.dropped:,} of {assignments:,} assignments dropped"))
        per_rank = routing.tokens_per_rank
        print(f"top-{k} of {NUM_EXPERTS} experts, {NUM_TOKENS} tokens: C = ceil({factor:g} × {NUM_TOKENS} × {k} / "
              f"{NUM_EXPERTS}) = {routing.capacity} slots per expert")
        print(f"dropped {routing.dropped:,} of {assignments:,} assignments ({routing.dropped / assignments:.1%}); "
              f"the busiest expert is asked for {routing.imbalance:.2f}× the even share (a capacity factor of "
              f"{routing.imbalance:.2f} or more drops nothing)")
        print(f"load-balancing loss {panel.aux_loss:.3f} (1.0 = even)", end="")
        if ranks == 1:
            print("; one rank holds every expert: no all-to-all")
        else:
            print(f"; on {plural(ranks, 'EP rank')} the busiest computes {max(per_rank) * ranks / sum(per_rank):.2f}× "
                  f"the mean, and each all-to-all sends {format_bytes(panel.wire_bytes)} per rank, fixed by C")

    panel.redraw_on_change(show)
    return panel
