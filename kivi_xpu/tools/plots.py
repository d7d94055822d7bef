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
