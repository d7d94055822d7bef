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


def _table(header: str, payload: dict, row_line, where: tuple[str, ...] | None = ()) -> str:
    """A tool's table: ``header``, a line ``row_line(r)`` per row of the payload (``None``: no line), then a line per
    skipped entry (``where`` ``None``: none): its cache, its ``where`` keys (— for None), — in the other columns,
    and the reason."""
    lines = [header, *(line for line in map(row_line, payload["rows"]) if line is not None)]
    columns = header.split("\n")[0].count("|") - 1
    for s in payload["skipped"] if where is not None else ():
        cells = [s["cache"], *("—" if s[k] is None else str(s[k]) for k in where)]
        lines.append("| " + " | ".join(cells + ["—"] * (columns - len(cells) - 1) + [s["reason"]]) + " |")
    return "\n".join(lines)


BENCH_HEADER = (
    "| cache | context | batch | prefill s | prefill vs Dynamic | decode tok/s | speed vs Dynamic | ms/step | "
    "step speedup vs Dynamic | step speedup vs Static | attn op ms | attn op GB/s | % of read BW | KV MiB | "
    "KV smaller by | decode peak MiB | token match | first divergence | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def bench_table(payload: dict) -> str:
    return _table(BENCH_HEADER, payload, _bench_line, where=("context", "batch"))


def _bench_line(r: dict) -> str:
    if r["token_match"] is None:
        match = divergence = "—"
    else:
        match = f"{100 * r['token_match']:.1f}%"
        divergence = "none" if r["first_divergence"] is None else str(r["first_divergence"])
    return (
        f"| {r['cache']} | {r['context']} | {r['batch']} | {r['prefill_seconds']:.3f} | "
        f"{_ratio(r['prefill_vs_dynamic'])} | {r['decode_tokens_per_s']:.1f} | {_ratio(r['speed_vs_dynamic'])} | "
        f"{_steps(r)} | {_fused_op(r)} | {_mib(r['kv_bytes'])} | {_ratio(r['memory_vs_dynamic'])} | "
        f"{_mib(r['peak_decode_bytes'])} | {match} | {divergence} | {_kv_note(r)} |"
    )


def _kv_note(r: dict) -> str:
    return "" if r["kv_check"] == "ok" else f"KV check: {r['kv_check']}"


def _fused_op(r: dict) -> str:
    """``attn op ms | attn op GB/s | % of read BW`` cells of a row: one fused attention op call, its packed bytes
    per second, and that rate as a share of the machine's read bandwidth."""
    if r["fused_op_ms"] is None:
        return "— | — | —"
    fraction = r["fused_op_bandwidth_fraction"]
    share = "—" if fraction is None else f"{100 * fraction:.0f}%"
    return f"{r['fused_op_ms']:.3f} | {r['fused_op_gb_per_s']:.2f} | {share}"


def _steps(r: dict) -> str:
    """``ms/step | vs Dynamic | vs Static`` cells of a row."""
    return f"{r['ms_per_step']:.2f} | {_ratio(r['step_speedup_vs_dynamic'])} | {_ratio(r['step_speedup_vs_static'])}"


# The columns of phases_table: a name and the thread ms of a call it covers, from the kernel's phases
# (csrc/cpu/decode_attention.h: Phase; the packed keys' and values' phases include their metadata and factors).
PHASE_COLUMNS = (
    ("read inputs", lambda p: p["read_inputs"]),
    ("key meta", lambda p: p["key_meta"]),
    ("key factors", lambda p: p["key_factors"]),
    ("key products", lambda p: p["packed_scores"] - p["key_meta"] - p["key_factors"]),
    ("softmax", lambda p: p["softmax"]),
    ("value meta", lambda p: p["value_meta"]),
    ("value factors", lambda p: p["value_factors"]),
    ("value products", lambda p: p["packed_values"] - p["value_meta"] - p["value_factors"]),
    ("exact sinks + tail", lambda p: p["exact_scores"] + p["exact_values"]),
    ("merge", lambda p: p["merge"]),
)


def phases_table(payload: dict) -> str:
    """Where a fused attention call's time goes (``kivi-xpu bench --phases``): per row with phase timings, the thread
    ms of one call (summed over the threads that ran it) and each phase's share of it."""
    names = " | ".join(name for name, _ in PHASE_COLUMNS)
    header = (
        f"| cache | context | batch | attn op ms | thread ms per call | {names} |\n"
        + "|---" * (5 + len(PHASE_COLUMNS))
        + "|"
    )
    return _table(header, payload, _phases_line, where=None)


def _phases_line(r: dict) -> str | None:
    phases = r.get("fused_op_phase_ms")
    if not phases:
        return None
    spent = [column(phases) for _, column in PHASE_COLUMNS]
    total = sum(spent)
    shares = " | ".join(f"{100 * ms / total:.1f}%" if total > 0 else "—" for ms in spent)
    return f"| {r['cache']} | {r['context']} | {r['batch']} | {r['fused_op_ms']:.3f} | {total:.3f} | {shares} |"


CURVE_HEADER = (
    "| cache | context | batch | ms/step | step speedup vs Dynamic | step speedup vs Static | decode tok/s | KV MiB | "
    "weights / attention / rest ms | attn op ms | attn op GB/s | % of read BW | fill s | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _parts(r: dict) -> str:
    """``weights / attention / rest`` ms of a step (—: not measured, e.g. on an accelerator)."""
    if r.get("weights_ms") is None:
        return "—"
    return f"{r['weights_ms']:.1f} / {r['attention_ms']:.1f} / {r['rest_ms']:.1f}"


def curve_table(payload: dict) -> str:
    return _table(CURVE_HEADER, payload, _curve_line)


def _curve_line(r: dict) -> str:
    return (
        f"| {r['cache']} | {r['context']} | {r['batch']} | {_steps(r)} | {r['decode_tokens_per_s']:.1f} | "
        f"{_mib(r['kv_bytes'])} | {_parts(r)} | {_fused_op(r)} | {r['fill_seconds']:.2f} | {_kv_note(r)} |"
    )


BUDGET_HEADER = (
    "| cache | context | KV budget MiB | KV per sequence MiB | batch | KV MiB at that batch | ms/step | "
    "decode tok/s (total) | tok/s vs Dynamic | batch vs Dynamic | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def budget_table(payload: dict) -> str:
    return _table(BUDGET_HEADER, payload, _budget_line, where=("context",))


def _budget_line(r: dict) -> str:
    notes = ["batch capped by --max-batch"] if r["batch_capped"] else []
    notes += [] if r["kv_check"] == "ok" else [f"KV check: {r['kv_check']}"]
    notes += [] if r["rows_match_one_sequence"] else ["a row decoded other tokens than the batch-1 run"]
    return (
        f"| {r['cache']} | {r['context']} | {_mib(r['budget_bytes'])} | {_mib(r['sequence_kv_bytes'])} | "
        f"{r['batch']} | {_mib(r['kv_bytes'])} | {r['ms_per_step']:.1f} | {r['decode_tokens_per_s']:.1f} | "
        f"{_ratio(r['tokens_per_s_vs_dynamic'])} | {_ratio(r['batch_vs_dynamic'])} | {'; '.join(notes)} |"
    )


def machine_line(payload: dict) -> str:
    """What a table was measured on: CPU model and ISA, the KIVI kernels' implementation, the competitor count,
    and the read bandwidth measured (``kivi-xpu bench``)."""
    env, settings = payload["environment"], payload["settings"]
    kernels = env["kivi_kernels"]
    details = ", ".join(kernels.get(k) or "" for k in ("isa", "attention_arithmetic") if kernels and kernels.get(k))
    implementation = "—" if kernels is None else kernels["backend"] + (f" ({details})" if details else "")
    measured, bandwidth = "", env.get("read_bandwidth")
    if bandwidth is not None:
        measured = f"; read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s (torch.sum over "
        measured += f"{bandwidth['buffer_bytes'] / MIB:.0f} MiB, {bandwidth['threads']} threads)"
    return (
        f"CPU: {env['cpu']['model']}; ISA: {' '.join(env['cpu']['isa']) or 'none of interest'}; torch threads: "
        f"{env['torch_threads']}; KIVI kernels: {implementation}; competitor processes (--contend): "
        f"{settings['contend']}{measured}"
    )


PPL_HEADER = (
    "| cache | mode | perplexity | Δ vs Dynamic | Δ % | windows | window ppl mean ± std | window min / max | "
    "window Δ mean ± std | scored tokens | KV MiB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def ppl_table(payload: dict) -> str:
    return _table(PPL_HEADER, payload, _ppl_line)


def _ppl_line(r: dict) -> str:
    delta_spread = (
        "—" if r["window_delta_mean"] is None else f"{r['window_delta_mean']:+.3f} ± {r['window_delta_std']:.3f}"
    )
    return (
        f"| {r['cache']} | {r['mode']} | {r['perplexity']:.3f} | {_signed(r['delta_vs_dynamic'])} | "
        f"{_signed(r['relative_delta_vs_dynamic'], 2, percent=True)} | {len(r['window_perplexities'])} | "
        f"{r['window_mean']:.3f} ± {r['window_std']:.3f} | {r['window_min']:.3f} / {r['window_max']:.3f} | "
        f"{delta_spread} | {r['scored_tokens']} | {r['kv_bytes'] / MIB:.2f} |"
    )
