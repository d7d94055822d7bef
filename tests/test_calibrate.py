"""`kivi-xpu calibrate`: the exact allocation solver, the layer_overrides file and KiviCache reading it, and one
end-to-end run on a tiny random Llama (head_dim 64, so the default candidates apply)."""

import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama_config
from transformers import LlamaForCausalLM

from kivi_xpu import KiviCache, KiviSettings, load_layer_overrides
from kivi_xpu.__main__ import main
from kivi_xpu.assets import byte_tokenizer
from kivi_xpu.tools import calibrate as calibrate_tool
from kivi_xpu.tools.calibrate import Scorer, allocate, duration

# ---------------------------------------------------------------------------------------------------------------
# allocation


def average(costs, choice, weights=None):
    weights = weights or [1] * len(costs)
    return sum(w * c[o] for w, c, o in zip(weights, costs, choice, strict=True)) / sum(weights)


def test_allocate_picks_the_obviously_best_and_spends_the_budget_exactly():
    # Options per layer: base (3 bits), cheaper (2.5), dearer (4). Layer 0 gains much from the dearer option,
    # layer 2 loses nothing going cheaper: at budget 3 the only good trade is 0 -> dearer paid by 1 and 2 cheaper.
    costs = [[3.0, 2.5, 4.0]] * 3
    losses = [[0.0, 0.5, -1.0], [0.0, 0.01, -0.001], [0.0, 0.0, -0.002]]
    choice = allocate(costs, losses, 3.0)
    assert choice == [2, 1, 1] and average(costs, choice) == 3.0
    # A budget a hair below 3 forbids that trade; the base is then too dear as well, so two layers go cheaper.
    assert average(costs, allocate(costs, losses, math.nextafter(3.0, 0))) < 3.0
    # Nothing to gain: the base everywhere (ties go to the cheaper total, here the cheaper option 1 of layer 2).
    assert allocate(costs, [[0.0, 0.1, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 0.0]], 3.0) == [0, 0, 1]
    # A big budget buys every dearer option; the cheapest possible allocation is always feasible.
    assert allocate(costs, losses, 10.0) == [2, 2, 2]
    assert allocate(costs, losses, 2.5) == [1, 1, 1]


def test_allocate_equals_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        layers, options = rng.randint(1, 4), rng.randint(1, 4)
        costs = [[rng.choice([2.5, 2.75, 3.0, 3.5, 4.0, 5.0]) for _ in range(options)] for _ in range(layers)]
        losses = [[rng.uniform(-1, 1) for _ in range(options)] for _ in range(layers)]
        weights = [rng.choice([1, 2, 3]) for _ in range(layers)]
        budget = rng.uniform(2.5, 5.0)
        feasible = [c for c in itertools.product(range(options), repeat=layers) if average(costs, c, weights) <= budget]
        if not feasible:
            with pytest.raises(ValueError, match="budget"):
                allocate(costs, losses, budget, weights)
            continue
        best = min(sum(s[o] for s, o in zip(losses, c, strict=True)) for c in feasible)
        choice = allocate(costs, losses, budget, weights)
        assert average(costs, choice, weights) <= budget
        assert sum(s[o] for s, o in zip(losses, choice, strict=True)) == pytest.approx(best, abs=1e-12)


def test_allocate_rejects_bad_input():
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate([[3.0, 2.5]], [[0.0, 1.0]], 2.4)
    with pytest.raises(ValueError, match="equal, non-empty"):
        allocate([[3.0, 2.5]], [[0.0]], 3.0)
    with pytest.raises(ValueError, match="weights"):
        allocate([[3.0]], [[0.0]], 3.0, weights=[0])


# ---------------------------------------------------------------------------------------------------------------
# the layer_overrides file


def config(layers=3):
    return tiny_llama_config(num_hidden_layers=layers)  # head_dim 32


def test_layer_overrides_file_sets_each_layer(tmp_path):
    entries = [{"key_bits": 4, "key_group_size": 16}, None, {"value_group_size": 16, "meta_dtype": "bfloat16"}]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"model": "tiny", "base": {"bits": 2}, "layer_overrides": entries}))
    base = KiviSettings(2, 32, 64)
    expected = [
        base.replace(key_bits=4, key_group_size=16),
        base,
        base.replace(value_group_size=16, meta_dtype=torch.bfloat16),
    ]
    for given in (path, str(path)):
        cache = KiviCache(config(), group_size=32, residual_length=64, layer_overrides=given)
        assert [layer.settings for layer in cache.layers] == expected
    # The bare list works too; meta_dtype names become dtypes.
    path.write_text(json.dumps(entries))
    assert load_layer_overrides(path)[2] == {"value_group_size": 16, "meta_dtype": torch.bfloat16}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot be read"),
        ("{not json", "not valid JSON"),
        (json.dumps({"model": "x"}), 'an object with nothing under "layer_overrides"'),
        (json.dumps({"layer_overrides": {"0": None}}), 'an object with a dict under "layer_overrides"'),
        (json.dumps(7), "got a JSON int"),
        (json.dumps([None, 4, None]), "entry 1 must be null or an object"),
        (
            json.dumps([None, {"meta_dtype": "float8"}, None]),
            "entry 1: `meta_dtype` must be one of \\['float16', 'bfloat16', 'float32'\\], got 'float8'",
        ),
        (json.dumps([None, None]), "has 2 entries but the model has 3 decoder layers"),
    ],
)
def test_bad_layer_overrides_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "overrides.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        KiviCache(config(), layer_overrides=path)
    assert "`layer_overrides` file" in str(error.value) and str(path) in str(error.value)


def test_a_bad_field_in_the_file_is_reported_for_its_layer(tmp_path):
    path = tmp_path / "overrides.json"
    path.write_text(json.dumps({"layer_overrides": [None, {"key_bits": 3}, None]}))
    with pytest.raises(ValueError, match=r"layer_overrides\[1\]`.*key_bits"):
        KiviCache(config(), layer_overrides=path)


# ---------------------------------------------------------------------------------------------------------------
# end to end


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(model directory, text file): a 3-layer random Llama with head_dim 64 and a byte tokenizer, and a text."""
    root = tmp_path_factory.mktemp("calibrate")
    model_dir = root / "model"
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=3, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    rng = random.Random(0)
    words = ["the", "cache", "keeps", "keys", "and", "values", "in", "two", "bits", "per", "element"]
    text = root / "text.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(1500)), encoding="utf-8")
    return model_dir, text


RUN = ["--prefill", "96", "--decode-steps", "6", "--windows", "2", "--group-size", "16", "--residual-length", "64"]
RUN += ["--backend", "reference"]  # the kernels are tested elsewhere; here only the tool


def run(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_calibrate_writes_overrides_within_the_budget_that_caches_and_eval_ppl_use(assets, tmp_path, capsys):
    model_dir, text = assets
    output = tmp_path / "calibration.json"
    args = ["calibrate", "--model", model_dir, "--text", text, *RUN, "--output", output, "--no-progress"]
    code, out, err = run(args, capsys)
    assert code == 0, err
    payload = json.loads(output.read_text())
    base = KiviSettings(2, 16, 64, torch.float16)
    assert payload["base"]["group_size"] == 16 and payload["base"]["meta_dtype"] == "float16"
    assert payload["budget"] == payload["base_bits_per_element"] == base.bits_per_element()
    # key_group_size=16 is the base's own (G=16), so it is left out; the others are valid with R=64, head_dim 64.
    labels = [c["label"] for c in payload["candidates"]]
    assert labels == ["value_group_size=64", "group_size=64", "key_bits=4", "bits=4"]
    assert [s["label"] for s in payload["skipped_candidates"]] == ["key_group_size=16"]
    # Every layer measured with every candidate; KL >= 0; dearer options lower the KL of the all-base cache.
    layers = payload["sensitivity"]["layers"]
    assert len(layers) == 3 and all(set(entry) == set(labels) for entry in layers)
    base_kl = payload["sensitivity"]["all_base"]
    assert base_kl > 0 and all(v >= 0 for entry in layers for v in entry.values())
    assert all(entry["bits=4"] < base_kl for entry in layers)
    # The chosen overrides respect the budget and are what the file gives a cache.
    chosen = payload["layer_overrides"]
    costs = [base if o is None else base.replace(**o) for o in chosen]
    assert payload["bits_per_element"] == pytest.approx(sum(s.bits_per_element() for s in costs) / 3)
    assert payload["bits_per_element"] <= payload["budget"]
    model_config = LlamaForCausalLM.config_class.from_pretrained(model_dir)
    cache = KiviCache(model_config, group_size=16, residual_length=64, meta_dtype=torch.float16, layer_overrides=output)
    assert [layer.settings for layer in cache.layers] == costs
    assert "| layer | base | value_group_size=64" in out and "chosen average" in out
    assert math.isfinite(payload["measured"]["chosen"]["kl"]) and payload["seconds"] > 0

    # eval-ppl takes the file through --kivi-option.
    ppl_args = ["eval-ppl", "--model", model_dir, "--text", text, "--caches", "kivi-fused", "--group-size", "16"]
    ppl_args += ["--residual-length", "64", "--prefill", "96", "--decode-steps", "6", "--windows", "2"]
    code, out, err = run([*ppl_args, "--kivi-option", f"layer_overrides={output}", "--no-progress"], capsys)
    assert code == 0, err
    assert f"layer_overrides={output}" in out


@pytest.mark.parametrize("below_base", [False, True])
def test_the_run_count_printed_first_is_the_runs_made(assets, tmp_path, capsys, monkeypatch, below_base):
    """The count printed before the first run equals the runs made (counted here as the reference run and every
    cache measured against it); the chosen run is left out only when every layer keeps the base. A budget below the
    base's forces a change, so that run is made. Then the estimate, from the first KIVI run's time, before the rest."""
    model_dir, text = assets
    made, lines = [], []
    init, measure = Scorer.__init__, Scorer.measure

    def counted_init(self, *args, **kwargs):
        made.append("reference")
        init(self, *args, **kwargs)

    def counted_measure(self, cache, *args, **kwargs):
        lines.append(capsys.readouterr().err)  # what was printed before this run
        made.append(cache.layer_overrides)
        return measure(self, cache, *args, **kwargs)

    monkeypatch.setattr(Scorer, "__init__", counted_init)
    monkeypatch.setattr(Scorer, "measure", counted_measure)
    output = tmp_path / "calibration.json"
    budget = ["--budget", str(KiviSettings(2, 16, 64, torch.float16).bits_per_element() - 0.1)] if below_base else []
    args = ["calibrate", "--model", model_dir, "--text", text, *RUN, *budget, "--output", output, "--no-progress"]
    code, _, err = run(args, capsys)
    assert code == 0, err
    printed = re.search(r"calibrate: 1 reference \+ 1 all-base \+ 3 layers x 4 candidates \+ 1 chosen = (\d+) runs, "
                        r"each 6 decode steps of 2 windows", lines[0])  # fmt: skip
    assert printed, lines[0]
    runs = int(printed.group(1))
    assert runs == 3 + 3 * 4 == calibrate_tool.run_count(3, 4)
    payload = json.loads(output.read_text())
    keeps_base = not any(payload["layer_overrides"])
    assert not (below_base and keeps_base)
    assert len(made) == payload["runs"] == (runs - 1 if keeps_base else runs)
    # The estimate comes after the all-base run (the first KIVI run) and before the layers' runs.
    estimate = re.search(r"the first KIVI run took ([\d.e+-]+) s, so the (\d+) runs left take ~(\d+) x", lines[1])
    assert estimate and "the first KIVI run" not in lines[0], lines[:2]
    assert int(estimate.group(2)) == runs - 2 and float(estimate.group(1)) > 0


def test_durations_read_as_seconds_minutes_or_hours():
    seconds = (4.2, 89, 95, 5399, 5400, 36000)
    assert [duration(s) for s in seconds] == ["4 s", "89 s", "2 min", "90 min", "1.5 h", "10.0 h"]


def test_the_prefill_written_with_update_equals_a_model_prefill(assets):
    # The calibration writes the reference prefill's states into each cache instead of prefilling through the model.
    model_dir, text = assets
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    tokens = torch.randint(0, 256, (2, 96 + 6 + 1))
    scorer = Scorer(model, tokens, 96, bar=_Counter())
    assert scorer.replay
    overrides = [None, {"key_bits": 4}, None]
    replayed = scorer.measure(KiviCache(model.config, group_size=16, residual_length=64, layer_overrides=overrides))
    scorer.replay = False
    prefilled = scorer.measure(KiviCache(model.config, group_size=16, residual_length=64, layer_overrides=overrides))
    assert replayed["kl"] > 0
    assert replayed["kl"] == pytest.approx(prefilled["kl"], rel=1e-4, abs=1e-7)
    assert replayed["nll"] == pytest.approx(prefilled["nll"], rel=1e-5)


class _Counter:
    def update(self, n=1):
        pass


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--budget", "1"], "--budget 1 is below the cheapest option's bits/element"),
        (["--kivi-option", "layer_overrides=x.json"], "calibrate chooses the per-layer settings itself"),
        (["--candidates", '[{"key_bits": 3}]'], "no --candidates entry is valid"),
    ],
)
def test_bad_input_is_one_error_line_before_measuring(assets, tmp_path, capsys, extra, message):
    model_dir, text = assets
    output = tmp_path / "out.json"
    args = ["calibrate", "--model", model_dir, "--text", text, *RUN, "--output", output, "--no-progress", *extra]
    code, out, err = run(args, capsys)
    assert code == 2 and err.startswith("error: ") and message in err and "Traceback" not in err
    assert not output.exists()


@pytest.mark.parametrize("candidates", ["{not json", "[]", '[{"bits": 4}, 3]', "[{}]"])
def test_bad_candidates_are_argparse_errors(candidates, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--candidates", candidates, "--output", str(Path("x.json"))])
    assert exit_info.value.code == 2 and "--candidates" in capsys.readouterr().err
