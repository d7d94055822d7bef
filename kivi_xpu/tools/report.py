"""The Markdown tables the tools print, from their JSON payloads."""

from __future__ import annotations

from .memory import MIB


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:.1f}"


def _signed(value: float | None, digits: int = 3, percent: bool = False) -> str:
    if value is None:
        return "—"
    return f"{100 * value:+.{digits}f}%" if percent else f"{value:+.{digits}f}"


BENCH_HEADER = (
    "| cache | context | batch | prefill s | prefill vs Dynamic | decode tok/s | speed vs Dynamic | KV MiB | "
    "KV smaller by | decode peak MiB | token match | first divergence | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def bench_table(payload: dict) -> str:
    lines = [BENCH_HEADER]
    for r in payload["rows"]:
        if r["token_match"] is None:
            match = divergence = "—"
        else:
            match = f"{100 * r['token_match']:.1f}%"
            divergence = "none" if r["first_divergence"] is None else str(r["first_divergence"])
        notes = "" if r["kv_check"] == "ok" else f"KV check: {r['kv_check']}"
        lines.append(
            f"| {r['cache']} | {r['context']} | {r['batch']} | {r['prefill_seconds']:.3f} | "
            f"{_ratio(r['prefill_vs_dynamic'])} | {r['decode_tokens_per_s']:.1f} | {_ratio(r['speed_vs_dynamic'])} | "
            f"{_mib(r['kv_bytes'])} | {_ratio(r['memory_vs_dynamic'])} | {_mib(r['peak_decode_bytes'])} | {match} | "
            f"{divergence} | {notes} |"
        )
    for s in payload["skipped"]:
        where = ["—" if s[k] is None else str(s[k]) for k in ("context", "batch")]
        lines.append(f"| {s['cache']} | {' | '.join(where)} | — | — | — | — | — | — | — | — | — | {s['reason']} |")
    return "\n".join(lines)


PPL_HEADER = (
    "| cache | mode | perplexity | Δ vs Dynamic | Δ % | windows | window ppl mean ± std | window min / max | "
    "window Δ mean ± std | scored tokens | KV MiB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def ppl_table(payload: dict) -> str:
    lines = [PPL_HEADER]
    for r in payload["rows"]:
        delta_spread = (
            "—" if r["window_delta_mean"] is None else f"{r['window_delta_mean']:+.3f} ± {r['window_delta_std']:.3f}"
        )
        lines.append(
            f"| {r['cache']} | {r['mode']} | {r['perplexity']:.3f} | {_signed(r['delta_vs_dynamic'])} | "
            f"{_signed(r['relative_delta_vs_dynamic'], 2, percent=True)} | {len(r['window_perplexities'])} | "
            f"{r['window_mean']:.3f} ± {r['window_std']:.3f} | {r['window_min']:.3f} / {r['window_max']:.3f} | "
            f"{delta_spread} | {r['scored_tokens']} | {r['kv_bytes'] / MIB:.2f} |"
        )
    for s in payload["skipped"]:
        lines.append(f"| {s['cache']} | — | — | — | — | — | — | — | — | — | {s['reason']} |")
    return "\n".join(lines)
