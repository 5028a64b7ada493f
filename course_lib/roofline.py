"""The roofline model, for teaching: is one layer's matmul limited by arithmetic or by memory?

Each of a layer's matmuls and its fused attention core at the GPU's dense peak and full HBM bandwidth, its
arithmetic intensity (FLOPs per byte) against the ridge point where the two limits meet. course_lib.kernel_times
turns the same idea into seconds, with the rates real kernels reach.
"""

from __future__ import annotations

from .hardware import find_gpu
from .kernel_times import attention_square, weight_widths
from .mesh import Mesh


def roofline(config, gpu, *, micro_batch_size: int, seq_len: int, tp: int = 1,
             bytes_per_element: int = 2) -> dict:
    """Arithmetic intensity of one layer's matmuls on one of ``tp`` GPUs, against the GPU's ridge point.

    A matmul [T, k] × [k, n] (T = micro_batch_size·seq_len tokens) does 2·T·k·n FLOPs and moves at least
    (T·k + k·n + T·n) · bytes_per_element bytes through HBM (read both operands, write the result once).
    intensity = FLOPs / bytes; ridge = peak / HBM bandwidth. Below the ridge the matmul waits on memory (its
    time is bytes / bandwidth), above it on compute (FLOPs / peak). The attention core is counted as a fused
    kernel (FlashAttention, torch's SDPA): it reads q, k, v and writes the output, never the s×s scores.
    Returns {"rows": [{name, flops, bytes, intensity, bound, seconds}], "intensity" (the layer's), "ridge",
    "bound"}. In bf16, large T: intensity → k·n/(k + n) FLOPs per byte, compute-bound; one token
    (decoding): just under 1, memory-bound on every GPU here (ridge points 150 to 300 FLOPs per byte).
    """
    hw = find_gpu(gpu)
    Mesh(tp=tp).check_model(config)
    tokens, e = micro_batch_size * seq_len, bytes_per_element
    widths = weight_widths(config, tp)
    q_width, kv_width = widths["q_proj"][1], widths["k_proj"][1]
    work = {name: (2 * tokens * k * n, (tokens * k + k * n + tokens * n) * e) for name, (k, n) in widths.items()}
    work["attention core"] = (attention_square(config, micro_batch_size, seq_len, tp),
                              tokens * (2 * q_width + 2 * kv_width) * e)
    rows = []
    for name, (flops, nbytes) in work.items():
        intensity = flops / nbytes
        rows.append({"name": name, "flops": flops, "bytes": nbytes, "intensity": intensity,
                     "bound": "compute" if intensity >= hw.ridge_point else "memory",
                     "seconds": max(flops / hw.peak_flops, nbytes / hw.hbm_bytes_per_s)})
    layer = sum(r["flops"] for r in rows) / sum(r["bytes"] for r in rows)
    return {"rows": rows, "intensity": layer, "ridge": hw.ridge_point,
            "bound": "compute" if layer >= hw.ridge_point else "memory"}
