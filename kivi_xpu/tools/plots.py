"""The PNG figures of ``kivi-xpu bench`` (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path

from .io import write_png
from .memory import MIB
from .options import ToolError


def check_matplotlib(option: str) -> None:
    """Fails before any measurement when a plot is asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ToolError(f"{option} needs matplotlib: pip install matplotlib") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _context_axis(ax, contexts: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def bench_plot(payload: dict, path: str) -> None:
    """KV MiB (top) and decode tokens/s (bottom) against context length, one line per cache, a column per batch."""
    plt = _pyplot()
    rows = payload["rows"]
    batches = sorted({r["batch"] for r in rows})
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 8), squeeze=False)
    for column, batch in enumerate(batches):
        for cache in caches:
            points = sorted((r["context"], r) for r in rows if r["cache"] == cache and r["batch"] == batch)
            contexts = [c for c, _ in points]
            axes[0][column].plot(contexts, [r["kv_bytes"] / MIB for _, r in points], marker="o", label=cache)
            axes[1][column].plot(contexts, [r["decode_tokens_per_s"] for _, r in points], marker="o", label=cache)
        axes[0][column].set_title(f"batch {batch}: KV cache memory")
        axes[0][column].set_ylabel("KV MiB")
        axes[1][column].set_title(f"batch {batch}: decode speed")
        axes[1][column].set_ylabel("tokens/s")
        contexts = sorted({r["context"] for r in rows})
        for ax in (axes[0][column], axes[1][column]):
            _context_axis(ax, contexts)
    fig.suptitle(f"{Path(payload['model']).name}: {payload['date'][:10]}")
    fig.tight_layout()
    write_png(path, fig)


def curve_plot(payload: dict, path: str) -> None:
    """Decode ms/step (left) and KV MiB (right) against context length (log-x), one line per cache and batch."""
    plt = _pyplot()
    rows = payload["rows"]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 5))
    for key in dict.fromkeys((r["cache"], r["batch"]) for r in rows):
        points = sorted((r["context"], r) for r in rows if (r["cache"], r["batch"]) == key)
        contexts, label = [c for c, _ in points], f"{key[0]} (batch {key[1]})"
        speed.plot(contexts, [r["ms_per_step"] for _, r in points], marker="o", label=label)
        memory.plot(contexts, [r["kv_bytes"] / MIB for _, r in points], marker="o", label=label)
    speed.set_title("decode time per step")
    speed.set_ylabel("ms/step")
    memory.set_title("KV cache memory")
    memory.set_ylabel("KV MiB")
    contexts = sorted({r["context"] for r in rows})
    for ax in (speed, memory):
        ax.set_yscale("log")
        _context_axis(ax, contexts)
    fig.suptitle(f"{payload['model']}: {payload['date'][:10]} ({payload['environment']['cpu']['model']})")
    fig.tight_layout()
    write_png(path, fig)


def budget_plot(payload: dict, path: str) -> None:
    """At one KV budget: the batch that fits (left) and the total decode tokens/s (right) of each cache, a group of
    bars per context."""
    plt = _pyplot()
    rows = payload["rows"]
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    contexts = sorted({r["context"] for r in rows})
    fig, (batches, speed) = plt.subplots(1, 2, figsize=(12, 5))
    width = 0.8 / len(caches)
    for i, cache in enumerate(caches):
        by_context = {r["context"]: r for r in rows if r["cache"] == cache}
        xs = [j + i * width for j, c in enumerate(contexts) if c in by_context]
        points = [by_context[c] for c in contexts if c in by_context]
        bars = batches.bar(xs, [r["batch"] for r in points], width, label=cache)
        batches.bar_label(bars, fontsize="small")
        bars = speed.bar(xs, [r["decode_tokens_per_s"] for r in points], width, label=cache)
        speed.bar_label(bars, [f"{r['decode_tokens_per_s']:.0f}" for r in points], fontsize="small")
    budget = rows[0]["budget_bytes"] / MIB if rows else 0
    batches.set_title(f"largest batch whose KV fits {budget:.0f} MiB")
    batches.set_ylabel("batch")
    speed.set_title("total decode tokens/s at that batch")
    speed.set_ylabel("tokens/s")
    for ax in (batches, speed):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))], [f"context {c}" for c in contexts])
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{Path(payload['model']).name}: {payload['date'][:10]} ({payload['environment']['cpu']['model']})")
    fig.tight_layout()
    write_png(path, fig)


# The docs' pictures (benchmarks/make_figures.py): README width is ~800 px, so 7.6 in at write_png's 110 dpi, with
# the machine and the command's settings in a caption under the axes.
DOCS_WIDTH_INCHES = 7.6
CAPTION_CHARACTERS = 128  # a caption line at 7 pt across the figure's width


def _docs_figure(panels: int, height: float = 3.6):
    plt = _pyplot()
    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8})
    fig, axes = plt.subplots(1, panels, figsize=(DOCS_WIDTH_INCHES, height), squeeze=False)
    return fig, list(axes[0])


def _finish(fig, title: str, caption: str, path: str, top: float = 1.0) -> None:
    """The title above, the caption (machine, settings, source JSON) below the axes, then the PNG."""
    import textwrap

    fig.suptitle(title, fontsize=11)
    caption = "\n".join(textwrap.fill(line, CAPTION_CHARACTERS) for line in caption.splitlines())
    below = (caption.count("\n") + 1) * 0.13 + 0.1  # inches the caption takes, added to the figure's height
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + below)
    fig.text(0.01, 0.01, caption, fontsize=7, ha="left", va="bottom", color="0.25")
    fig.tight_layout(rect=(0, below / (height + below), 1, top))
    write_png(path, fig)


def lines_plot(
    panels: list[tuple[str, dict[str, list[tuple[float, ...]]]]],
    path: str,
    *,
    title: str,
    ylabel: str,
    caption: str,
    xlabel: str = "context (tokens)",
    styles: dict[str, dict] | None = None,
    annotate_last: bool = False,
    legend_loc: str = "best",
    notes: list[str] | None = None,
) -> None:
    """One panel per ``(panel title, {series label: [(x, y), ...]})``, x on a log-2 axis with the measured points as
    ticks, y from zero (a point ``(x, y, low, high)`` has a bar from ``low`` to ``high``: a spread over runs);
    ``styles`` maps a label to matplotlib line keywords; ``annotate_last`` writes each series'
    last value beside its last point; ``notes`` holds a text per panel, written at its left above the middle; the legend
    goes in the first panel."""
    fig, axes = _docs_figure(len(panels))
    for i, (ax, (panel_title, series)) in enumerate(zip(axes, panels, strict=True)):
        if notes and notes[i]:
            ax.text(0.04, 0.6, notes[i], transform=ax.transAxes, ha="left", va="center", fontsize=8)
        xs = sorted({point[0] for points in series.values() for point in points})
        for label, points in series.items():
            points = sorted(points)
            x, y = [p[0] for p in points], [p[1] for p in points]
            style = (styles or {}).get(label, {})
            if all(len(p) == 4 for p in points):
                spread = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
                ax.errorbar(x, y, yerr=spread, capsize=3, label=label, **({"marker": "o"} | style))
            else:
                ax.plot(x, y, label=label, **({"marker": "o"} | style))
            if annotate_last and points:
                x, y = points[-1][:2]
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(4, 0), va="center", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc=legend_loc)
    _finish(fig, title, caption, path)


def grouped_bars_plot(
    panels: list[tuple[str, str, dict[str, list[float]]]],
    groups: list[str],
    path: str,
    *,
    title: str,
    caption: str,
    value_format: str = "{:.0f}",
) -> None:
    """One panel per ``(panel title, y label, {series label: [value per group]})``: a group of bars per entry of
    ``groups`` (its x label), each bar labelled with its value."""
    fig, axes = _docs_figure(len(panels))
    for ax, (panel_title, ylabel, series) in zip(axes, panels, strict=True):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            bars = ax.bar(
                [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))], values, width, label=label
            )
            ax.bar_label(bars, [value_format.format(v) for v in values], fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.margins(y=0.12)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncols=len(labels), bbox_to_anchor=(0.5, 0.93), frameon=False)
    _finish(fig, title, caption, path, top=0.9)


def quality_plot(points: list[dict], path: str, *, title: str, caption: str) -> None:
    """Perplexity increase (%) against bits per element: one marker per ``{"label", "bits", "delta", "error"}``
    (``error``: the spread of the per-window increases, drawn as an error bar; ``series``: points of one series share
    a colour), 0 % being the full-precision cache."""
    fig, (ax,) = _docs_figure(1, height=3.9)
    colours = {}
    for p in points:
        series = p.get("series", p["label"])
        colour = colours.setdefault(series, f"C{len(colours)}")
        ax.errorbar(p["bits"], p["delta"], yerr=p.get("error"), fmt=p.get("marker", "o"), color=colour, capsize=3)
        ax.annotate(
            p["label"],
            (p["bits"], p["delta"]),
            textcoords="offset points",
            xytext=(7, p.get("dy", 0)),
            fontsize=8,
            va="center",
        )
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xlabel("bits per stored KV element (codes + their share of scales and zeros)")
    ax.set_ylabel("perplexity increase over fp32 DynamicCache (%)")
    ax.set_xlim(2.4, 6.2)
    ax.grid(True, alpha=0.3)
    _finish(fig, title, caption, path)
