"""What every figure needs to read well, whatever its data: a unit that shows the numbers, plurals, labels and
titles inside the frame, and bars wide enough to see.

A label written beside a bar or a point is placed in data coordinates plus an offset in points, so how far it
reaches depends on the final size of the axes: these helpers run after the figure is laid out, measure what
was drawn (in display pixels), and widen the data range or wrap the title until everything fits."""

import textwrap

from ...units import GiB, KiB, MiB, TiB

BYTE_UNITS = (("B", 1), ("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("TiB", TiB))


def plural(count: int, word: str, words: str | None = None) -> str:
    """``plural(1, "rank")`` → "1 rank", ``plural(4, "rank")`` → "4 ranks"; ``words`` for a plural that is not
    word + "s" ("micro-batches")."""
    return f"{count} {word}" if count == 1 else f"{count} {words or word + 's'}"


def byte_unit(largest_bytes: float) -> tuple[str, int]:
    """The largest binary unit in which ``largest_bytes`` is at least 1: (name, bytes per unit). The biggest
    number on a figure then reads 1 to 1,023 and never "0.0"."""
    name, scale = BYTE_UNITS[0]
    for unit_name, unit_scale in BYTE_UNITS:
        if largest_bytes >= unit_scale:
            name, scale = unit_name, unit_scale
    return name, scale


def unit_label(unit: str, scale: int) -> str:
    """An axis label for a byte unit: "GiB (2**30 bytes)", or "bytes"."""
    return "bytes" if scale == 1 else f"{unit} (2**{scale.bit_length() - 1} bytes)"


def amount(value: float) -> str:
    """A number for a label: one decimal from 1 up ("13.2", "1,024.0"), two significant digits below 1
    ("0.031"), so a small value next to a big one still shows; nothing at all is "0"."""
    if value == 0:
        return "0"
    return f"{value:,.1f}" if abs(value) >= 1 else f"{value:.2g}"


def _widen(axis, limits: tuple[float, float], length_px: float, low_px: float, high_px: float, most: float):
    """New limits of ``axis`` with ``low_px`` more room before the data and ``high_px`` after it, worked out in
    the axis' own scale (linear or log), so the data shrinks towards the middle and frees that many pixels;
    never a span (in that scale) over ``most``."""
    scale = axis.get_transform()                       # data → linear (log10 for a log axis)
    low, high = scale.transform(list(limits))
    per_px = (high - low) / length_px
    low_room, high_room = max(low_px, 0) * per_px, max(high_px, 0) * per_px
    if high - low + low_room + high_room > most:       # share out what is left
        shrink = max(0.0, most - (high - low)) / (low_room + high_room)
        low_room, high_room = low_room * shrink, high_room * shrink
    return tuple(scale.inverted().transform([low - low_room, high + high_room]))


def _span(axis, limits) -> float:
    low, high = axis.get_transform().transform(list(limits))
    return high - low


def keep_texts_inside(ax, *, pad_px: float = 3.0, rounds: int = 10) -> None:
    """Widen the limits of ``ax`` until every text drawn in it lies inside its frame, ``pad_px`` from the edge.
    Each round moves the data away from the edge a text crosses by as many pixels as it crosses it; as the
    text's anchor moves with the data too, a few rounds settle it. The data keeps at least a quarter of the
    frame: labels longer than that stay where they are rather than squash the figure to nothing."""
    fig = ax.figure
    most_x, most_y = 4 * _span(ax.xaxis, ax.get_xlim()), 4 * _span(ax.yaxis, ax.get_ylim())
    for _ in range(rounds):
        renderer = fig.canvas.get_renderer()
        frame = ax.get_window_extent(renderer)
        boxes = [t.get_window_extent(renderer) for t in ax.texts if t.get_visible() and t.get_text() and _on_data(ax, t)]
        if not boxes:
            return
        left = frame.x0 + pad_px - min(b.x0 for b in boxes)
        right = max(b.x1 for b in boxes) - (frame.x1 - pad_px)
        bottom = frame.y0 + pad_px - min(b.y0 for b in boxes)
        top = max(b.y1 for b in boxes) - (frame.y1 - pad_px)
        if max(left, right, bottom, top) <= 0.5:
            return
        if max(left, right) > 0.5:
            ax.set_xlim(_widen(ax.xaxis, ax.get_xlim(), frame.width, left, right, most_x))
        if max(bottom, top) > 0.5:
            ax.set_ylim(_widen(ax.yaxis, ax.get_ylim(), frame.height, bottom, top, most_y))


def _on_data(ax, text) -> bool:
    """Whether ``text`` is anchored at a data point (so new limits move it), not at a place on the axes."""
    anchor = getattr(text, "xycoords", None)         # an annotation: where its arrow points
    return anchor == "data" if anchor is not None else text.get_transform() == ax.transData


def wrap_title(ax, *, loc: str = "center") -> None:
    """Make the title of ``ax`` no wider than the axes (a long title otherwise runs over the legend or off
    the figure): see :func:`fit_text`."""
    title = ax.title if loc == "center" else getattr(ax, f"_{loc}_title")
    fit_text(title, ax.get_window_extent(ax.figure.canvas.get_renderer()).width)


def wrap_suptitle(fig) -> None:
    """Make the figure's title no wider than the figure: see :func:`fit_text`."""
    if fig._suptitle is not None:
        fit_text(fig._suptitle, fig.bbox.width * 0.96)


MIN_TITLE_FONTSIZE = 8


def fit_text(text, width_px: float) -> None:
    """Fit ``text`` in ``width_px``: first a smaller font, down to ``MIN_TITLE_FONTSIZE`` (the words stay as
    they are, for whoever reads the title back), then, if that is not enough, lines broken between words."""
    content = text.get_text()
    if not content:
        return
    renderer = text.figure.canvas.get_renderer()
    drawn = text.get_window_extent(renderer).width
    if drawn <= width_px:
        return
    size = text.get_fontsize()
    text.set_fontsize(max(MIN_TITLE_FONTSIZE, 0.97 * size * width_px / drawn))   # (widths are not quite linear)
    drawn = text.get_window_extent(renderer).width
    if drawn > width_px:
        characters = max(10, int(len(content) * width_px / drawn * 0.95))
        text.set_text("\n".join(textwrap.wrap(" ".join(content.split("\n")), characters)))


def settle(fig, *axes, tight_layout_rect=None) -> None:
    """Lay ``fig`` out so nothing spills: lay it out once to know each axes' width, wrap the titles to it, then
    alternately lay out and keep each axes' texts inside it (widening an axes' limits can change its tick
    labels, and so the layout)."""
    fig.tight_layout(rect=tight_layout_rect)
    wrap_suptitle(fig)
    for ax in axes:
        wrap_title(ax)
        wrap_title(ax, loc="left")
    for _ in range(2):
        fig.tight_layout(rect=tight_layout_rect)
        for ax in axes:
            keep_texts_inside(ax)


def widen_thin_bars(ax, bars, *, min_px: float = 4.0) -> None:
    """Draw every bar of ``bars`` (horizontal, on a linear x axis) at least ``min_px`` wide on screen: a 0.2 ms
    all-reduce in a 30 ms step is otherwise a 1-pixel line, and one not finished yet (no width) invisible.
    Call it once the figure is laid out."""
    x0, x1 = ax.get_xlim()
    data_per_px = (x1 - x0) / ax.get_window_extent(ax.figure.canvas.get_renderer()).width
    for bar in bars:
        if bar.get_width() < min_px * data_per_px:
            bar.set_width(min_px * data_per_px)
