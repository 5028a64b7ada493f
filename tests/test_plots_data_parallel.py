"""course_lib.presentation.plots for data parallelism (notebooks 02 and 03): the ring all-reduce step by step, the
replicas' drift, the DDP step split into phases and its timeline per rank, and ZeRO's bytes per rank, wire bytes,
memory over a step and the explorer's figure, each drawn from small inputs and checked for what it should show,
every label inside its frame. tests/test_plots.py checks the other figures."""

import re

import matplotlib
import matplotlib.pyplot as plt
import pytest
from test_plots import GIB, NAMES, bars, lines_at, outside_figure, spilled, texts

from course_lib.ledger import zero_state_bytes
from course_lib.presentation import plots
from course_lib.runs.ddp import phase_seconds
from course_lib.zero_bytes import wire_bytes_per_step

matplotlib.use("Agg")   # no window, on any machine


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# ---- 02 · data parallelism ----------------------------------------------------------------------------

def ring_snapshots(p: int) -> list[list]:
    """What ddp.ring_all_reduce records on each of ``p`` ranks when rank r starts with 2**r everywhere, one
    element per chunk: (phase, step, [each chunk's first element]) after every step."""
    chunks = [[2.0**r] * p for r in range(p)]
    snapshots = [[] for _ in range(p)]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            before = [list(c) for c in chunks]
            for r in range(p):
                left = before[(r - 1) % p]
                if phase == "reduce-scatter":
                    chunks[r][(r - s - 1) % p] += left[(r - s - 1) % p]
                else:
                    chunks[r][(r - s) % p] = left[(r - s) % p]
                snapshots[r].append((phase, s, list(chunks[r])))
    assert chunks == [[2.0**p - 1] * p] * p       # every rank ends with the sum in every chunk
    return snapshots


def test_ring_all_reduce_steps_draws_a_grid_per_step_and_outlines_what_arrived():
    p = 3
    fig = plots.ring_all_reduce_steps(ring_snapshots(p))
    steps = 1 + 2 * (p - 1)
    assert len(fig.axes) == 6                                  # 5 pictures on 2 rows of 3, the last one blank
    assert [ax.get_title() for ax in fig.axes[:steps]] == ["start: rank r holds g_r", "reduce-scatter 1/2",
                                                          "reduce-scatter 2/2", "all-gather 1/2", "all-gather 2/2"]
    assert not fig.axes[-1].axison
    assert len(fig.axes[0].patches) == p * p                    # the start: nothing arrived yet
    for ax in fig.axes[1:steps]:
        arrived = [patch for patch in ax.patches if not patch.get_fill()]
        assert len(ax.patches) == p * p + p and len(arrived) == p    # one chunk arrives on every rank per step
    assert sorted(texts(fig.axes[0])) == sorted(str(r) for r in range(p) for _ in range(p))
    assert texts(fig.axes[steps - 1]) == ["Σ"] * p * p          # the end: every chunk holds every rank's data
    assert texts(fig.axes[2]).count("Σ") == p                  # after the reduce-scatter: one full chunk per rank
    assert "the 3 chunks" in fig._suptitle.get_text()


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_all_reduce_labels_fit_in_their_cells_and_the_title_in_the_figure(p):
    fig = plots.ring_all_reduce_steps(ring_snapshots(p))
    fig.canvas.draw()
    for ax in fig.axes[:1 + 2 * (p - 1)]:
        cells = [patch for patch in ax.patches if patch.get_fill()]
        for text, cell in zip(ax.texts, cells):                    # one label per cell, drawn in the same order
            box, room = text.get_window_extent(), cell.get_window_extent()
            assert room.x0 < box.x0 and box.x1 < room.x1 and room.y0 < box.y0 and box.y1 < room.y1, text.get_text()
        assert min(t.get_fontsize() for t in ax.texts) >= 7
    assert outside_figure(fig) == []


def test_replica_drift_draws_one_line_per_setup_from_step_one():
    curves = {"no sync": [0.01, 0.02, 0.05], "all-reduce": [0.0, 0.0, 0.0]}
    fig = plots.replica_drift(curves, title="drift")
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == list(curves)
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2, 3] and list(ax.get_lines()[1].get_ydata()) == [0.0] * 3
    assert ax.get_title() == "drift" and ax.get_xlabel() == "optimizer step"


def step_record(start, compute, exposed, optimizer, bucket_log=None):
    """A record of ddp.train_step: when each phase ended, and the all-reduces issued in the step."""
    record = {"start": start, "backward": start + compute, "synced": start + compute + exposed,
              "end": start + compute + exposed + optimizer}
    if bucket_log is not None:
        record["bucket_log"] = bucket_log
    return record


def test_step_time_split_stacks_the_phases_of_each_setup_and_dims_the_others():
    rows = {"naive": phase_seconds([[step_record(0, 0.010, 0.004, 0.001)] * 3] * 2),
            "64 KiB": phase_seconds([[step_record(0, 0.010, 0.001, 0.001)] * 3] * 2)}
    assert set(rows["naive"]) == {"compute", "exposed communication", "optimizer", "step"}
    fig = plots.step_time_split(rows, highlight="64 KiB", title="2 ranks")
    ax = fig.axes[0]
    assert len(bars(ax)) == 2 * 3                                   # "step" is the total, not a phase
    assert [t.get_text() for t in ax.get_yticklabels()] == ["64 KiB", "naive"]      # first row on top
    alphas = [b.get_alpha() for b in bars(ax)]
    assert alphas == [1.0] * 3 + [0.45] * 3                         # the highlighted row in full colour
    assert sorted(texts(ax)) == ["12.0 ms", "15.0 ms"] and ax.get_title() == "2 ranks"


def test_ddp_timeline_draws_three_phases_and_each_all_reduce_per_rank():
    buckets = [{"bucket": 0, "bytes": 1024, "issued": 1.004, "done": 1.006},
               {"bucket": 1, "bytes": 1024, "issued": 1.008}]              # still in flight: no "done"
    steps_by_rank = [step_record(1.000, 0.010, 0.002, 0.001, buckets), step_record(1.001, 0.010, 0.001, 0.001)]
    fig = plots.ddp_timeline(steps_by_rank, title="step 1")
    ax = fig.axes[0]
    assert len(bars(ax)) == 2 * 3 + 2                   # compute, exposed, optimizer per rank; rank 0's buckets
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert min(b.get_x() for b in bars(ax)) == 0.0       # ms from the first rank's start
    orange = [b for b in bars(ax) if matplotlib.colors.to_hex(b.get_facecolor()) == matplotlib.colors.to_hex("tab:orange")]
    assert [b.get_x() for b in orange] == pytest.approx([4.0, 8.0])
    assert orange[0].get_width() == pytest.approx(2.0) and orange[1].get_width() > 0   # an unfinished one still shows
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["compute", "exposed communication", "optimizer", "all-reduce of one bucket (issued → done)"]
    assert ax.get_title() == "step 1"


def test_pack_rows_shares_a_row_between_all_reduces_that_follow_each_other():
    from course_lib.presentation.plots.ddp import pack_rows
    assert pack_rows([(0, 1), (1, 2), (2, 3)]) == [0, 0, 0]          # one after the other: one row
    assert pack_rows([(0, 5), (1, 2), (3, 4), (4.5, 6)]) == [0, 1, 1, 1]
    assert pack_rows([(0, 5), (1, 6), (2, 7)]) == [0, 1, 2]          # all in flight at once: a row each
    assert pack_rows([]) == []


def many_buckets(start: float, count: int, *, each: float, spacing: float) -> list[dict]:
    """``count`` all-reduces issued ``spacing`` s apart, each taking ``each`` s (overlapping when each > spacing)."""
    return [{"bucket": i, "bytes": 256, "issued": start + i * spacing, "done": start + i * spacing + each}
            for i in range(count)]


@pytest.mark.parametrize(("each", "spacing"), [(0.0002, 0.0003), (0.008, 0.0002)])   # naive in a row; queued
def test_ddp_timeline_draws_every_bar_at_least_a_few_pixels_wide_and_tall(each, spacing):
    steps_by_rank = [step_record(0.0, 0.015, 0.012, 0.0001, many_buckets(0.008, 39, each=each, spacing=spacing))
                     for _ in range(4)]
    fig = plots.ddp_timeline(steps_by_rank, title="step 3 of 25 MiB (torch's default): compute and all-reduces on "
                                                  "every rank")
    ax = fig.axes[0]
    fig.canvas.draw()
    assert len(bars(ax)) == 4 * (3 + 39)
    for bar in bars(ax):
        box = bar.get_window_extent()
        assert box.width >= 3.9 and box.height >= 3.5           # no 1-pixel lines: the optimizer's 0.1 ms too
    assert outside_figure(fig) == []                             # the long title wraps to the axes' width
    assert ax.title.get_window_extent().x1 <= ax.get_window_extent().x1 + 1


def test_bubble_curves_draw_the_formula_and_the_measured_dots_for_each_depth():
    measured = {2: {1: 0.50, 4: 0.21}, 4: {4: 0.44, 8: 0.28}}
    fig = plots.bubble_curves(measured, max_microbatches=16, title="the bubble")
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["p = 2: (p−1)/(m+p−1)", "p = 2: measured",
                                                     "p = 4: (p−1)/(m+p−1)", "p = 4: measured"]
    assert len(lines[0].get_xdata()) == 16 and lines[0].get_ydata()[0] == pytest.approx(50.0)
    assert list(lines[3].get_xdata()) == [4, 8] and list(lines[3].get_ydata()) == pytest.approx([44.0, 28.0])
    assert ax.get_xscale() == "log" and ax.get_ylim() == (0, 100) and ax.get_title() == "the bubble"


# ---- 03 · ZeRO and FSDP ------------------------------------------------------------------------------

def test_zero_per_rank_bars_draw_a_panel_per_ranks_and_stage_with_the_formula():
    params = 1000
    measured = {n: {s: [zero_state_bytes(params, s, n) for _ in range(n)] for s in range(4)} for n in (1, 4)}
    predicted = {n: {s: zero_state_bytes(params, s, n)["total"] for s in range(4)} for n in (1, 4)}
    fig = plots.zero_per_rank_bars(measured, predicted, unit=("B", 1), title="tiny")
    assert len(fig.axes) == 2 * 4
    for ax, (n, s) in zip(fig.axes, [(n, s) for n in (1, 4) for s in range(4)]):
        assert ax.get_title() == f"{NAMES[s]}, {n} rank" + ("s" if n > 1 else "")      # "1 rank", "4 ranks"
        assert len(bars(ax)) == 3 * n and len(lines_at(ax, y=predicted[n][s])) == 1
        assert max(b.get_y() + b.get_height() for b in bars(ax)) == pytest.approx(predicted[n][s])
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"r{r}" for r in range(n)]
        assert spilled(ax) == []                                  # "formula …" stays under the frame's top
    assert fig.axes[0].get_ylabel() == "B per rank" and fig._suptitle.get_text() == "tiny"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights", "grads", "optimizer"]


def notebook_03_wire():
    """Notebook 03's 4-rank run: the traced bytes per op (the formula, op by op) and gloo's count per stage."""
    grad_bytes = 328_832                                            # Ψ of the tiny model in bf16
    traced = {NAMES[s]: wire_bytes_per_step(grad_bytes, s, 4) for s in range(4)}
    counted = {NAMES[0]: 505_344, NAMES[1]: 758_016, NAMES[2]: 758_016, NAMES[3]: 1_010_688}
    return traced, counted


def written_ratios(ax) -> tuple[list[str], list[str]]:
    """The ratios written on the bars and beside the diamonds, first row first."""
    diamonds = {line.get_ydata()[0]: line.get_xdata()[0] for line in ax.get_lines() if line.get_marker() == "D"}
    on_bars, beside_diamonds = {}, {}
    for text in ax.texts:
        x, y = text.xy
        (beside_diamonds if diamonds.get(y) == x else on_bars)[y] = text.get_text()
    return ([on_bars[y] for y in sorted(on_bars, reverse=True)],
            [beside_diamonds[y] for y in sorted(beside_diamonds, reverse=True)])


def test_zero_wire_bytes_write_each_ratio_on_the_quantity_it_is_the_ratio_of():
    traced, counted = notebook_03_wire()
    fig = plots.zero_wire_bytes(traced, counted=counted, title="4 ranks")
    ax = fig.axes[0]
    assert len(bars(ax)) == 1 + 2 + 2 + 2
    assert [t.get_text() for t in ax.get_yticklabels()] == list(traced)[::-1]
    on_bars, beside_diamonds = written_ratios(ax)
    traced_total = [sum(ops.values()) for ops in traced.values()]
    assert on_bars == [f"{t / traced_total[0]:.2f}×" for t in traced_total] == ["1.00×", "1.00×", "1.00×", "1.50×"]
    counts = list(counted.values())                                 # the table printed above the chart in 03
    assert beside_diamonds == [f"{c / counts[0]:.2f}×" for c in counts] == ["1.00×", "1.50×", "1.50×", "2.00×"]
    assert spilled(ax) == []
    for text in ax.texts:                                           # a ratio on a bar lies on its bar's end
        x, y = text.xy
        if text.get_text() in on_bars and x not in {line.get_xdata()[0] for line in ax.get_lines()}:
            end = max(b.get_x() + b.get_width() for b in bars(ax) if b.get_y() < y < b.get_y() + b.get_height())
            assert x == pytest.approx(end) and text.get_window_extent().x1 <= ax.transData.transform((end, y))[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == sorted(["all-reduce", "reduce-scatter", "all-gather", "counted by the kernel (gloo)"])
    assert ax.get_title() == "4 ranks" and "in the bar, traced; beside ◆, counted" in ax.get_xlabel()


def test_zero_wire_bytes_without_a_count_write_the_traced_ratio_after_each_bar():
    traced, counted = notebook_03_wire()
    ax = plots.zero_wire_bytes(traced).axes[0]
    assert [line for line in ax.get_lines() if line.get_marker() == "D"] == []
    assert written_ratios(ax) == (["1.00×", "1.00×", "1.00×", "1.50×"], [])
    ax = plots.zero_wire_bytes(traced, counted={**counted, NAMES[1]: None}).axes[0]     # a stage not counted
    assert len([line for line in ax.get_lines() if line.get_marker() == "D"]) == 3
    assert written_ratios(ax)[1] == ["1.00×", "1.50×", "2.00×"]


def zero_step(units=("layers.0", "layers.1"), shard=100, block=400):
    """ZeroDataParallel.memory_trace of one ZeRO-3 step on one rank: each unit gathered forward, then backward."""
    events, t, held = [], 10.0, shard

    def record(event, unit, weights, grads):
        nonlocal t
        t += 0.001
        events.append({"time": t, "event": event, "unit": unit, "weights": weights, "grads": grads})

    for unit in units:
        record("gather (forward)", unit, held + block, 0)
        record("free (forward)", unit, held, 0)
    for unit in units[::-1]:
        record("gather (backward)", unit, held + block, 0)
        record("gradients ready", unit, held + block, block)
        record("reduce gradients", unit, held, shard)
    record("step", None, held, shard)
    return events


def test_zero_memory_trace_draws_weights_and_grads_over_the_step_with_each_gather_named():
    timeline = zero_step()
    fig = plots.zero_memory_trace(timeline, shard_bytes=100, unit=("B", 1), title="ZeRO-3, rank 0")
    weights, grads = fig.axes
    assert weights.get_title() == "ZeRO-3, rank 0" and grads.get_xlabel() == "milliseconds since the step began"
    (step,) = [line for line in weights.get_lines() if line.get_drawstyle() == "steps-post"]
    assert list(step.get_ydata()) == [e["weights"] for e in timeline]
    assert len(lines_at(weights, y=100)) == len(lines_at(grads, y=100)) == 1
    gathers = [t for t in texts(weights) if t.startswith("layers.")]
    assert gathers == ["layers.0", "layers.1", "layers.1", "layers.0"]          # forward order, then backward
    assert {"forward", "backward", "this rank's shard only"} <= set(texts(weights))
    assert weights.get_ylabel() == "weights, B" and grads.get_ylabel() == "grads, B"


def test_zero_memory_trace_without_a_shard_or_a_backward_draws_no_guides():
    forward_only = [{**e, "grads": 100} for e in zero_step() if e["event"].endswith("(forward)")]
    fig = plots.zero_memory_trace(forward_only, unit=("B", 1))
    weights, _ = fig.axes
    assert "forward" not in texts(weights) and lines_at(weights, y=100) == []


def test_zero_explorer_figure_draws_state_and_traffic_per_stage_with_the_chosen_one_in_full_colour():
    params = int(7.1e9)
    memory = {NAMES[s]: zero_state_bytes(params, s, 8) for s in range(4)}
    wire = {NAMES[s]: sum(wire_bytes_per_step(2 * params, s, 8).values()) for s in range(4)}
    fig = plots.zero_explorer_figure(memory, wire, highlight="ZeRO-1", capacity_bytes=24 * GIB,
                                     capacity_label="24 GiB (RTX 4090)", title="7.1B, 8 ranks")
    state, traffic = fig.axes
    assert len(bars(state)) == 4 * 3 and len(bars(traffic)) == 4
    assert [t.get_text() for t in state.get_yticklabels()] == list(memory)[::-1]
    full = [t.get_text() for t, b in zip(state.get_yticklabels(), bars(traffic)) if b.get_alpha() == 1.0]
    assert full == ["ZeRO-1"]
    assert len(lines_at(state, x=24)) == 1 and "24 GiB (RTX 4090)" in texts(state)
    over = [t.get_text() for t in state.texts if t.get_color() == "tab:red"]
    assert sorted(over) == sorted(f"{row['total'] / GIB:,.1f}" for row in memory.values() if row["total"] > 24 * GIB)
    assert len(over) == 3                               # on a 24 GiB card only ZeRO-3 fits (13.2 GiB)
    assert state.get_xlabel() == "GiB of training state per rank" and traffic.get_xlabel() == "GiB each rank sends per step"
    assert fig._suptitle.get_text() == "7.1B, 8 ranks"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights", "grads", "optimizer"]
    assert spilled(state) == spilled(traffic) == []


def test_zero_explorer_figure_picks_units_that_show_a_tiny_models_numbers():
    params = 164_416                                    # the course's tiny model
    memory = {NAMES[s]: zero_state_bytes(params, s, 8) for s in range(4)}
    wire = {NAMES[s]: sum(wire_bytes_per_step(2 * params, s, 8).values()) for s in range(4)}
    fig = plots.zero_explorer_figure(memory, wire, highlight="ZeRO-3", capacity_bytes=80 * GIB,
                                     capacity_label="80 GiB (A100 80GB)")
    state, traffic = fig.axes
    assert state.get_xlabel() == "MiB of training state per rank" and traffic.get_xlabel() == "KiB each rank sends per step"
    numbers = [t for t in texts(state) + texts(traffic) if re.fullmatch(r"[\d,.]+", t)]
    assert len(numbers) == 8 and not any(float(n.replace(",", "")) == 0 for n in numbers)   # no "0.0" anywhere
    assert numbers[:4] == [f"{memory[name]['total'] / 2**20:.2g}" if memory[name]["total"] < 2**20
                           else f"{memory[name]['total'] / 2**20:,.1f}" for name in list(memory)[::-1]]
    assert max(b.get_x() + b.get_width() for b in bars(state)) > 0.5 * state.get_xlim()[1]   # not squashed by the card
    assert "80 GiB (A100 80GB): far to the right, everything fits" in texts(state)
    one_rank = plots.zero_explorer_figure({n: zero_state_bytes(params, s, 1) for s, n in NAMES.items()},
                                          {n: 0.0 for n in NAMES.values()}, highlight="ZeRO-1")
    assert "one rank: nothing to send" in texts(one_rank.axes[1]) and "0" in texts(one_rank.axes[1])
