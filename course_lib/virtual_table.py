"""``python -m course_lib.virtual``'s table: one rank's record (virtual.run_rank) beside the formulas' numbers,
every size in GiB, each row marked measured or computed, and whether the rank fits on a card."""

from __future__ import annotations

from .hardware import find_gpu


def _number(nbytes, unit: int) -> str:
    """Bytes in ``unit`` (2**30: GiB; 1: a count), four significant digits; "-" where there is no number."""
    return "-" if nbytes is None else f"{nbytes / unit:.4g}"


def format_result(result: dict, gpu: str | None = None) -> str:
    """run_rank's record as a table, every size in GiB (2**30 bytes), each beside the formula's number and marked
    measured or computed; with ``gpu`` (a hardware.GPUS name), whether the rank's peak fits on that card."""
    formula, computed = result["formulas"], set(result["computed"])
    coords = ", ".join(f"{axis} {index}" for axis, index in result["coords"].items())
    spans = result["layers"] if isinstance(result["layers"][0], list) else [result["layers"]]
    lines = [f"rank {result['rank']} of {result['world_size']} ({coords}): layers "
             + " and ".join(f"[{first}, {end})" for first, end in spans) + " (first included, end excluded)",
             f"{'':30}{'this run':>12}{'formula':>12}"]

    def row(label, run, expected, unit, source):
        lines.append(f"  {label:<28}{_number(run, unit):>12}{_number(expected, unit):>12}  {source}".rstrip())

    how = "computed" if "state_bytes" in computed else "measured"
    lines.append("state, GiB")
    for part in ("weights", "grads", "optimizer", "total"):
        row(part, result["state_bytes"][part], formula["state_bytes"][part], 2**30, how)
    row("while stepping (ZeRO-2/3)", None, formula["transient_bytes"]["total"], 2**30, "formula (test_zero_reshard)")
    lines.append("activations, GiB")
    row("per micro-batch", result["activation_bytes_per_microbatch"], formula["activation_bytes_per_microbatch"],
        2**30, "measured")
    row("in flight (micro-batches)", result["microbatches_in_flight"], formula["microbatches_in_flight"], 1, "measured")
    row("peak", result["activation_bytes_peak"], formula["activation_bytes_peak"], 2**30, "measured")
    lines.append("sent per step, GiB")
    for axis, sent in result["sent_bytes"].items():
        ops = ", ".join(f"{op} x {count}" for op, count in result["ops"].get(axis, {}).items()) or "no ops"
        source = "computed" if f"sent_bytes.{axis}" in computed else f"measured: {ops}"
        row(axis, sent, formula["sent_bytes"].get(axis), 2**30, source)
    if gpu is not None:
        card, peak = find_gpu(gpu), sum((result["state_bytes"]["total"], formula["transient_bytes"]["total"],
                                         result["activation_bytes_peak"]))
        lines.append(f"on {card.name} ({card.memory_bytes / 2**30:.0f} GiB): state + while stepping + activations peak = "
                     f"{peak / 2**30:.4g} GiB: it {'fits' if peak <= card.memory_bytes else 'does NOT fit'} (before "
                     "the allocator's reserve and buffers)")
    lines.append(f"ran in {result['seconds']:.1f} s on a fake process group with meta tensors; formulas: "
                 "course_lib.per_rank (no ZeRO padding)")
    return "\n".join(lines)
