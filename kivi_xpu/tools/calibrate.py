"""Per-layer KIVI settings for a memory budget, from a short calibration on a text (KVTuner-style, training-free).

    kivi-xpu calibrate --model smollm2 --text wikipedia --output calibration.json
    python -m kivi_xpu.tools.calibrate ...  (the same options)
    KiviCache(config, layer_overrides="calibration.json")  # or eval-ppl --kivi-option layer_overrides=...

Sensitivity: ``--windows`` windows of ``P + D + 1`` tokens from the start of the text (as ``kivi-xpu eval-ppl
--eval-mode decode``) are prefilled (P tokens) and decoded D steps with teacher forcing, the cache in the loop;
each step's next-token distribution is compared with that of the full-precision ``DynamicCache`` by the KL
divergence KL(full precision || cache) in nats, averaged over the K x D steps. This is measured for the all-base
cache (the base: KiviCache with --bits, --group-size, --residual-length, --meta-dtype and the --kivi-option's)
and, for every KIVI layer l and every candidate c of the menu, for the cache where only layer l takes c. The
prefill's keys and values are computed once (with exact attention, as every cache's prefill attends to the exact
states) and written into each fresh cache with ``cache.update``, so a configuration costs its D decode steps only.

Cost: 3 + L x C runs of D decode steps (:func:`run_count`; each step one forward pass of the K windows as a batch)
for L KIVI layers and C valid candidates: the reference (after the one prefill), the all-base cache, every layer x
candidate, and the chosen configuration (left out when every layer keeps the base). A model with sliding-window
layers prefills in every run. The tool prints the count before it starts, then the first KIVI run's time and what
the runs left take at that pace.

Allocation: one option (the base or a candidate) per layer, minimising the summed sensitivity increases
``KL(l takes c) - KL(all base)`` subject to the average bits/element (:meth:`KiviSettings.bits_per_element`,
weighted per layer by kv heads x head_dim) <= ``--budget`` (default: the base's, i.e. the memory of the default
cache). This assumes that the layers' effects add up; the chosen configuration is measured at the end, so the
output shows the measured KL beside the predicted one. Solved exactly (:func:`allocate`).

Output (``--output``): JSON with ``layer_overrides`` (one ``null`` or dict per decoder layer), ``base`` (the settings
the overrides are relative to: give the file to a cache with these settings), ``budget``, ``bits_per_element``,
``sensitivity`` (every measurement), ``measured`` (reference, all-base and chosen), ``runs`` (the runs made),
``settings``, ``environment``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..cache import KiviCache, config_head_dim
from ..integration import cache_argument
from ..layer import KiviLayer
from ..overrides import model_fingerprint, override_entry, settings_json
from .cli import add_kivi_arguments, add_model_arguments, apply_process_options, positive_int, progress, tool_main
from .eval_ppl import TEXT_HELP, decode_logits, evaluation_tokens
from .io import check_output_path, write_json
from .loading import load_model
from .machine import report_header
from .options import ToolError, ToolOptions
from .specs import kivi_kwargs

# Relative to the base: two cheaper (coarser groups) and three dearer (finer key groups, 4-bit keys, 4 bits).
DEFAULT_CANDIDATES = (
    {"value_group_size": 64},
    {"group_size": 64},
    {"key_group_size": 16},
    {"key_bits": 4},
    {"bits": 4},
)


@dataclass(kw_only=True)
class CalibrateOptions(ToolOptions):
    """The settings of ``kivi-xpu calibrate`` (see the module docstring)."""

    caches: list[str] = field(default_factory=lambda: ["kivi-fused"])  # the fused path, as the default cache runs
    text: str = "wikipedia"
    prefill: int = 512  # P
    decode_steps: int = 32  # D
    windows: int = 4  # K
    budget: float | None = None  # average bits/element (None: the base's)
    candidates: list[dict] = field(default_factory=lambda: [dict(c) for c in DEFAULT_CANDIDATES])

    @property
    def eval_mode(self) -> str:
        """What :func:`~kivi_xpu.tools.eval_ppl.evaluation_tokens` reads: windows as in decode mode."""
        return "decode"


DEFAULTS = CalibrateOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kivi-xpu calibrate`` / ``python -m kivi_xpu.tools.calibrate``."""
    add_model_arguments(p)
    p.add_argument("--text", default=DEFAULTS.text, help=TEXT_HELP)
    p.add_argument(
        "--prefill", type=positive_int, default=DEFAULTS.prefill, help="P, tokens prefilled per window (512)"
    )
    p.add_argument(
        "--decode-steps", type=positive_int, default=DEFAULTS.decode_steps, help="D, teacher-forced steps compared (32)"
    )
    p.add_argument("--windows", type=positive_int, default=DEFAULTS.windows, help="K, windows, run as one batch (4)")
    p.add_argument("--bits", type=_one_bit_width, default=DEFAULTS.bits, help="the base's bits (2, 4 or 8; 2)")
    add_kivi_arguments(p)
    p.add_argument(
        "--budget",
        type=_positive_float,
        help="largest average bits/element (codes + scales/zeros, KiviSettings.bits_per_element) over the layers "
        "(default: the base's, the memory of the default cache)",
    )
    p.add_argument(
        "--candidates",
        type=_candidates,
        default=DEFAULTS.candidates,
        help="JSON list of per-layer changes to the base to try, default "
        + json.dumps(list(DEFAULT_CANDIDATES)).replace("%", "%%"),
    )
    p.add_argument("--output", "--json", dest="json", required=True, metavar="PATH", help="the JSON file to write")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(caches=list(DEFAULTS.caches))


def _one_bit_width(text: str) -> list[int]:
    return [positive_int(text)]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _candidates(text: str) -> list[dict]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"must be JSON, a list of objects such as '[{{\"key_bits\": 4}}]': {err}"
        ) from None
    if not isinstance(value, list) or not value or not all(isinstance(c, dict) and c for c in value):
        raise argparse.ArgumentTypeError(f"must be a non-empty JSON list of non-empty objects, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Allocation


def allocate(costs: list[list[float]], losses: list[list[float]], budget: float, weights=None) -> list[int]:
    """One option per layer: ``choice[l]`` indexes ``costs[l]`` / ``losses[l]`` (the options of layer l), so that
    ``sum(losses[l][choice[l]])`` is smallest subject to the weighted average cost
    ``sum(w[l] * costs[l][choice[l]]) / sum(w)`` <= ``budget`` (``weights`` default 1 per layer).

    Exact: the costs, weights and budget are turned into exact fractions (floats are binary fractions) and a
    dynamic programme over the layers keeps, for each reachable total cost, the smallest total loss, dropping
    totals that cost more for no lower loss. Among equal losses the cheaper total wins, then the lower option
    indices. Assumes the losses of the layers add up. Raises ``ValueError`` when even the cheapest options exceed
    the budget, or for ragged or empty input.
    """
    if (
        not costs
        or len(costs) != len(losses)
        or any(len(c) != len(s) or not c for c, s in zip(costs, losses, strict=False))
    ):
        raise ValueError("`costs` and `losses` must be lists of equal, non-empty per-layer option lists")
    weights = [1] * len(costs) if weights is None else list(weights)
    if len(weights) != len(costs) or any(not w > 0 for w in weights):
        raise ValueError(f"`weights` must give one positive weight per layer ({len(costs)}), got {weights}")
    exact = [[Fraction(c) * Fraction(w) for c in layer] for layer, w in zip(costs, weights, strict=True)]
    cap = Fraction(budget) * sum(Fraction(w) for w in weights)
    cheapest = [min(layer) for layer in exact]
    # rest[l]: the least the layers from l on can cost, so a partial total that cannot be completed is dropped.
    rest = [sum(cheapest[i:], Fraction(0)) for i in range(len(exact) + 1)]
    if rest[0] > cap:
        lowest = float(rest[0] / sum(Fraction(w) for w in weights))
        raise ValueError(f"budget {budget} is below the cheapest allocation's average ({lowest:g})")
    frontier = {Fraction(0): (0.0, ())}  # total cost -> (total loss, choices)
    for index, (layer_costs, layer_losses) in enumerate(zip(exact, losses, strict=True)):
        grown: dict[Fraction, tuple[float, tuple]] = {}
        for total, (loss, choices) in frontier.items():
            for option, (cost, extra) in enumerate(zip(layer_costs, layer_losses, strict=True)):
                new_total = total + cost
                if new_total + rest[index + 1] > cap:
                    continue
                candidate = (loss + float(extra), (*choices, option))
                if new_total not in grown or candidate < grown[new_total]:
                    grown[new_total] = candidate
        frontier, best = {}, math.inf
        for total in sorted(grown):  # keep a dearer total only when its loss is lower
            if grown[total][0] < best:
                frontier[total], best = grown[total], grown[total][0]
    total = min(frontier, key=lambda t: (frontier[t][0], t))
    return list(frontier[total][1])


# ---------------------------------------------------------------------------------------------------------------
# Measurement


def candidate_menu(base, candidates: list[dict], head_dim: int) -> tuple[list[dict], list[dict]]:
    """The candidates that are valid with the base and differ from it and from each other, as
    ``{"override" (as given), "label", "bits_per_element"}``; and the others with the reason they were left out."""
    menu, skipped, seen = [], [], {base}
    for override in candidates:
        label = _label(override)
        try:
            settings = base.replace(**override_entry(override, f"candidate {label}"))
            settings.check_head_dim(head_dim)
        except (TypeError, ValueError) as err:
            skipped.append({"override": override, "label": label, "reason": str(err)})
            continue
        if settings in seen:
            skipped.append({"override": override, "label": label, "reason": "same settings as the base or another"})
            continue
        seen.add(settings)
        menu.append({"override": override, "label": label, "bits_per_element": settings.bits_per_element()})
    return menu, skipped


def _label(override: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in override.items())


class Scorer:
    """The reference (``DynamicCache``) run of the windows ``tokens [K, P + D + 1]``, and :meth:`measure` of a
    cache against it: mean KL(reference || cache) and mean NLL over the K x D decode predictions."""

    def __init__(self, model, tokens: torch.Tensor, prefill: int, bar):
        self.model, self.tokens, self.prefill, self.bar = model, tokens, prefill, bar
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(tokens[:, :prefill], **cache_argument(cache), use_cache=True, logits_to_keep=1)
        # Each layer's prefill keys/values [K, H_kv, P, D] (DynamicLayer.update concatenates into new tensors, so
        # these stay the prefill's). Other layer kinds (sliding windows) keep a cut; those models prefill per run.
        self.states = [(layer.keys, layer.values) for layer in cache.layers]
        self.replay = all(type(layer) is DynamicLayer for layer in cache.layers)
        self.reference = torch.stack(list(self._steps(cache)), dim=1)  # log-probabilities [K, D, vocab]
        targets = tokens[:, prefill + 1 :]
        self.reference_nll = -self.reference.gather(-1, targets.unsqueeze(-1)).mean().item()

    def _steps(self, cache):
        for logits in decode_logits(self.model, cache, self.tokens, self.prefill):
            self.bar.update(1)
            yield F.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def measure(self, cache, attn_implementation: str = "kivi") -> dict:
        """``{"kl", "nll"}`` of ``cache`` (empty; filled with the windows' prefill here) against the reference."""
        if self.replay:
            for index, (keys, values) in enumerate(self.states):
                cache.update(keys, values, index)
        self.model.set_attn_implementation(attn_implementation)
        try:
            if not self.replay:
                self.model(self.tokens[:, : self.prefill], **cache_argument(cache), use_cache=True, logits_to_keep=1)
            kl = nll = 0.0
            targets = self.tokens[:, self.prefill + 1 :]
            for i, log_q in enumerate(self._steps(cache)):
                log_p = self.reference[:, i]
                kl += (log_p.exp() * (log_p - log_q)).sum(-1).sum().item()
                nll -= log_q.gather(-1, targets[:, i : i + 1]).sum().item()
        finally:
            self.model.set_attn_implementation("sdpa")
        count = targets.numel()
        return {"kl": kl / count, "nll": nll / count}


def layer_weights(states, kivi_layers: list[int]) -> list[int]:
    """Elements one token adds to each KIVI layer (kv heads x (key + value head_dim)), from the prefill states."""
    return [states[i][0].shape[1] * (states[i][0].shape[-1] + states[i][1].shape[-1]) for i in kivi_layers]


def calibrate(options: CalibrateOptions) -> dict:
    """Runs the calibration the options describe and returns the JSON payload."""
    check_output_path(options.json, "--output")
    if any(name == "layer_overrides" for name, _ in options.kivi_options):
        raise ToolError("--kivi-option layer_overrides=...: calibrate chooses the per-layer settings itself")
    apply_process_options(options)
    model, model_path = load_model(options.model, options.dtype, options.device)
    base_kwargs = kivi_kwargs(options, options.bits[0])
    try:  # layer_overrides=None: the base is every layer alike (and "auto" would log that there is no calibration)
        base_cache = KiviCache(config=model.config, **base_kwargs, layer_overrides=None)
    except (ValueError, TypeError, RuntimeError) as err:
        shown = ", ".join(f"{k}={v!r}" for k, v in base_kwargs.items() if v is not None)
        raise ToolError(f"KiviCache({shown}): {err}") from None
    base = base_cache.settings.for_model_dtype(model.dtype)  # the metadata dtype the cache will store, named
    decoder = model.config.get_text_config(decoder=True)
    kivi_layers = [i for i, layer in enumerate(base_cache.layers) if isinstance(layer, KiviLayer)]
    if not kivi_layers:
        raise ToolError(f"model {options.model!r} has no full-attention layer for KIVI to quantize")
    head_dim = config_head_dim(decoder)
    menu, skipped = candidate_menu(base, options.candidates, head_dim)
    if not menu:
        raise ToolError("no --candidates entry is valid with the base settings: " + json.dumps(skipped))
    costs = [base.bits_per_element(), *(c["bits_per_element"] for c in menu)]
    budget = base.bits_per_element() if options.budget is None else options.budget
    if min(costs) > budget:
        raise ToolError(f"--budget {budget:g} is below the cheapest option's bits/element ({min(costs):g})")
    tokens = evaluation_tokens(options, model, model_path).to(model.device)

    runs = run_count(len(kivi_layers), len(menu))
    print(
        f"calibrate: 1 reference + 1 all-base + {len(kivi_layers)} layers x {len(menu)} candidates + 1 chosen = "
        f"{runs} runs, each {options.decode_steps} decode steps of {options.windows} windows (the chosen run is "
        "left out when every layer keeps the base)",
        file=sys.stderr,
        flush=True,
    )
    made = 0
    start = time.perf_counter()
    with progress(not options.no_progress, total=runs * options.decode_steps, desc="calibrate", unit="step") as bar:
        bar.set_description_str("full precision")
        scorer = Scorer(model, tokens, options.prefill, bar)
        made += 1

        def measure(overrides, what: str) -> dict:
            nonlocal made
            bar.set_description_str(what)
            entries = None if overrides is None else [override_entry(e, "override") for e in overrides]
            cache = KiviCache(config=model.config, **base_kwargs, layer_overrides=entries)
            made += 1
            return scorer.measure(cache)

        first = time.perf_counter()
        all_base = measure(None, "all base")
        _say(bar, estimate(time.perf_counter() - first, runs - made))
        layers = [None] * len(base_cache.layers)
        for n, layer in enumerate(kivi_layers):
            layers[layer] = {}
            for candidate in menu:
                overrides = [candidate["override"] if i == layer else None for i in range(len(layers))]
                what = f"layer {layer} ({n + 1}/{len(kivi_layers)}) {candidate['label']}"
                layers[layer][candidate["label"]] = measure(overrides, what)
        weights = layer_weights(scorer.states, kivi_layers)
        losses = [[0.0, *(layers[i][c["label"]]["kl"] - all_base["kl"] for c in menu)] for i in kivi_layers]
        choice = allocate([costs] * len(kivi_layers), losses, budget, weights)
        chosen = [None] * len(layers)
        for layer, option in zip(kivi_layers, choice, strict=True):
            chosen[layer] = None if option == 0 else dict(menu[option - 1]["override"])
        measured_chosen = measure(chosen, "chosen") if any(chosen) else dict(all_base)
        bar.update(runs * options.decode_steps - bar.n)  # the chosen run is skipped when it is the base
    seconds = time.perf_counter() - start

    average = sum(w * costs[o] for w, o in zip(weights, choice, strict=True)) / sum(weights)
    predicted = all_base["kl"] + sum(loss[o] for loss, o in zip(losses, choice, strict=True))
    return report_header("kivi-xpu calibrate", options, model_path=model_path) | {
        "fingerprint": model_fingerprint(model.config),
        "text": options.text,
        "evaluated": {"windows": options.windows, "prefill": options.prefill, "decode_steps": options.decode_steps},
        "budget": budget,
        "base": settings_json(base),
        "base_bits_per_element": base.bits_per_element(),
        "bits_per_element": average,
        "layer_overrides": chosen,
        "candidates": menu,
        "skipped_candidates": skipped,
        "sensitivity": {
            "metric": "mean KL(DynamicCache || cache) of the next-token distribution, nats per decode step; "
            "per layer: only that layer takes the candidate, the others the base (null: not a KIVI layer)",
            "all_base": all_base["kl"],
            "layers": [None if entry is None else {label: m["kl"] for label, m in entry.items()} for entry in layers],
            "layers_nll": [
                None if entry is None else {label: m["nll"] for label, m in entry.items()} for entry in layers
            ],
        },
        "measured": {
            "reference_nll": scorer.reference_nll,
            "all_base": all_base,
            "chosen": measured_chosen,
            "chosen_predicted_kl": predicted,
        },
        "runs": made,
        "seconds": seconds,
    }


def run_count(kivi_layers: int, candidates: int) -> int:
    """The runs (of D decode steps each) a calibration of ``kivi_layers`` KIVI layers and ``candidates`` valid
    candidates makes at most: the reference, the all-base cache, every layer x candidate, the chosen configuration
    (left out when every layer keeps the base)."""
    return 3 + kivi_layers * candidates


def estimate(seconds: float, left: int) -> str:
    """The line that says what the ``left`` runs take at the pace of the first KIVI run, ``seconds`` long."""
    return (
        f"calibrate: the first KIVI run took {seconds:.3g} s, so the {left} runs left take ~{left} x {seconds:.3g} s "
        f"= ~{duration(left * seconds)}"
    )


def duration(seconds: float) -> str:
    """``seconds`` for a reader: seconds up to 90, minutes up to 90, then hours."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _say(bar, line: str) -> None:
    """``line`` on stderr, above the progress bar when one is drawn."""
    if hasattr(bar, "write"):
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Report


def calibration_table(payload: dict) -> str:
    """Per KIVI layer: the increase of KL (x 1e-3 nats) each candidate causes alone, the chosen one marked ``*``;
    then the budget, the averages and the measured KL and perplexities."""
    candidates = payload["candidates"]
    labels = [c["label"] for c in candidates]
    names = ["base", *labels]
    sensitivity, overrides = payload["sensitivity"], payload["layer_overrides"]
    base_kl = sensitivity["all_base"]
    lines = [
        "| layer | " + " | ".join(names) + " |",
        "|---|" + "---:|" * (len(labels) + 1),
    ]
    for index, (entry, chosen) in enumerate(zip(sensitivity["layers"], overrides, strict=True)):
        if entry is None:
            continue
        chosen_label = "base" if chosen is None else next(c["label"] for c in candidates if c["override"] == chosen)
        cells = [f"{(entry[label] - base_kl) * 1e3:+.2f}" for label in labels]
        marked = [
            f"{cell} *" if label == chosen_label else cell for cell, label in zip(["0", *cells], names, strict=True)
        ]
        lines.append(f"| {index} | " + " | ".join(marked) + " |")
    bits = [payload["base_bits_per_element"], *(c["bits_per_element"] for c in candidates)]
    lines.append("| bits/element | " + " | ".join(f"{b:.3g}" for b in bits) + " |")
    m = payload["measured"]
    lines += [
        "",
        f"KL increase over the all-base cache, x 1e-3 nats per step, one layer changed at a time; * = chosen. "
        f"Budget {payload['budget']:.4g} bits/element; chosen average {payload['bits_per_element']:.4g} "
        f"(base {payload['base_bits_per_element']:.4g}).",
        f"KL vs DynamicCache: all base {m['all_base']['kl']:.5f}, chosen {m['chosen']['kl']:.5f} (predicted "
        f"{m['chosen_predicted_kl']:.5f}); perplexity: DynamicCache {math.exp(m['reference_nll']):.3f}, all base "
        f"{math.exp(m['all_base']['nll']):.3f}, chosen {math.exp(m['chosen']['nll']):.3f}; {payload['seconds']:.0f} s.",
    ]
    return "\n".join(lines)


def command(args) -> None:
    """``kivi-xpu calibrate``: run, print the table, write --output."""
    options = CalibrateOptions.from_namespace(args)
    payload = calibrate(options)
    print(calibration_table(payload), flush=True)
    write_json(options.json, payload)


def main(argv=None) -> int:
    return tool_main("kivi_xpu.tools.calibrate", __doc__, add_arguments, command, argv)


if __name__ == "__main__":
    sys.exit(main())
