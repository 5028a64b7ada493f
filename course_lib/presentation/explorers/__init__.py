"""ipywidgets panels the notebooks share, called as ``explorers.NAME``. Each computes what it shows for real:
``formulas`` from the ledger, ZeRO and plan formulas (instant), ``live`` by training or running ranks (seconds,
cached). ``_panel`` holds what they share: the panel, its redraw loop and busy state, and the words it prints."""

from .experts import moe_explorer
from .formulas import (
    GPUS,
    PLAN_GPUS,
    ZERO_RANKS,
    failures_explorer,
    memory_explorer,
    plan_explorer,
    zero_explorer,
)
from .live import (
    DDP_BUCKETS,
    LEARNING_RATES,
    ddp_overlap_explorer,
    learning_rate_explorer,
    pipeline_explorer,
    tp_speed_explorer,
)
from .long_context import long_context_explorer

__all__ = ["DDP_BUCKETS", "GPUS", "LEARNING_RATES", "PLAN_GPUS", "ZERO_RANKS", "ddp_overlap_explorer",
           "learning_rate_explorer", "long_context_explorer", "memory_explorer", "pipeline_explorer", "plan_explorer", "tp_speed_explorer",
           "zero_explorer", "moe_explorer", "failures_explorer"]
