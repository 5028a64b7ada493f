"""Figures the notebooks share, one module per notebook's topic (matplotlib: static PNGs that read well on
GitHub and in CI; ``interactive.py`` has the plotly ones). Notebooks call them as ``plots.NAME``. ``readable.py``
holds what every figure shares to stay readable: units from the data, plurals, labels kept inside the frame."""

from .ddp import ddp_timeline, replica_drift, ring_all_reduce_steps, step_time_split
from .experts import dropped_share, expert_load
from .failures import checkpoint_waste
from .incidents import gradient_magnitudes, trace_timeline
from .mesh import bytes_per_axis, mesh_layout
from .pipeline import bubble_curves, pipeline_gantt
from .tensor_parallel import matmul_split, speed_words, tp_speed
from .training import loss_curves, memory_bars, predicted_vs_measured
from .zero import ZERO_STAGE_NAMES, zero_explorer_figure, zero_memory_trace, zero_per_rank_bars, zero_wire_bytes

__all__ = ["ZERO_STAGE_NAMES", "bubble_curves", "bytes_per_axis", "ddp_timeline", "loss_curves", "matmul_split", "memory_bars",
           "mesh_layout", "pipeline_gantt", "predicted_vs_measured", "replica_drift", "ring_all_reduce_steps",
           "speed_words", "step_time_split", "tp_speed", "zero_explorer_figure", "zero_memory_trace", "zero_per_rank_bars",
           "zero_wire_bytes",
           "dropped_share", "expert_load",   # 08 · experts
           "checkpoint_waste",               # 10 · checkpoints and failures
           "trace_timeline", "gradient_magnitudes"]   # 11 · when parallel training goes wrong
