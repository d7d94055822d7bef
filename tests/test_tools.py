"""The command-line tools (`kivi-xpu bench`, `kivi-xpu eval-ppl`) on a tiny random Llama saved as a local checkpoint
directory with a word-level tokenizer, and the Wikipedia markup stripping of kivi_xpu.assets."""

import importlib
import json
import math
import random
import runpy
import sys
import zipfile

import pytest
import torch
from tiny_models import tiny_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import kivi_xpu.assets
from kivi_xpu import KiviCache, attention
from kivi_xpu.__main__ import main
from kivi_xpu.assets import GENSIM_LEE, GENSIM_WHEEL, news_text, strip_wiki_markup, wiki_articles
from kivi_xpu.integration import cache_argument
from kivi_xpu.tools import calibrate, curve, machine, report, shapes, side_by_side, specs, workload
from kivi_xpu.tools import eval_ppl as evaluate
from kivi_xpu.tools.loading import load_model, resolve_text
from kivi_xpu.tools.options import ToolError, ToolOptions
from kivi_xpu.tools.timing import fused_op_timer, op_stats

MAX_POSITIONS = 256
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
# G=16, R=16: KIVI quantizes from the first tokens on, so short runs exercise the packed history.
KIVI = ["--group-size", "16", "--residual-length", "16"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(model directory, text file): a tiny random Llama with a word-level tokenizer, and ~3000 words of text."""
    root = tmp_path_factory.mktemp("tools")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(200)]
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + " ." for _ in range(400)]
    text = root / "text.txt"
    text.write_text("\n".join(sentences), encoding="utf-8")

    vocab = {token: i for i, token in enumerate(["[UNK]", ".", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = root / "model"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir, text


def run(args, capsys):
    """(exit code, stdout, stderr) of `kivi-xpu <args>` run in this process."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(args, tmp_path, capsys) -> dict:
    path = tmp_path / "out.json"
    code, out, err = run([*args, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    assert out.startswith("| cache |")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------------------
# bench


def test_bench_reports_consistent_rows_a_table_and_a_plot(assets, tmp_path, capsys):
    model_dir, _ = assets
    plot = tmp_path / "bench.png"
    contexts, batches, new_tokens = [24, 96], [1, 2], 5
    payload = run_json(
        [
            "bench",
            "--model",
            model_dir,
            "--contexts",
            *contexts,
            "--batch-sizes",
            *batches,
            "--new-tokens",
            new_tokens,
            "--warmup",
            1,
            "--repeats",
            1,
            "--bits",
            2,
            *KIVI,
            "--plot",
            plot,
            "--caches",
            "dynamic",
            "kivi-fused",
            "kivi-dense",
            "quanto",
            "hqq",
        ],  # fmt: skip
        tmp_path,
        capsys,
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    expected = ["dynamic", "kivi-fused 2-bit", "kivi-dense 2-bit", "quanto 2-bit", "hqq 2-bit"]
    installed = {"quanto 2-bit": importable("optimum.quanto"), "hqq 2-bit": importable("hqq.core.quantize")}
    ran = [c for c in expected if installed.get(c, True)]
    assert [s["cache"] for s in payload["skipped"]] == [c for c in expected if c not in ran]
    assert all(s["reason"].startswith("not installed") for s in payload["skipped"])
    rows = payload["rows"]
    assert [(r["context"], r["batch"], r["cache"]) for r in rows] == [
        (c, b, cache) for c in contexts for b in batches for cache in ran
    ]
    for r in rows:
        assert r["kv_check"] == "ok", r
        assert r["kv_measured_bytes"] == r["kv_allocated_bytes"] >= r["kv_bytes"] > 0
        assert r["generated_tokens"] == new_tokens and len(r["runs"]) == 1
        assert r["prefill_seconds"] > 0 and r["decode_tokens_per_s"] > 0
        assert 0 <= r["token_match"] <= 1
        if payload["environment"]["peak_memory_method"] is not None:
            assert r["peak_process_bytes"] > 0
        if r["cache"] == "dynamic":
            assert r["token_match"] == 1.0 and r["first_divergence"] is None
            assert r["speed_vs_dynamic"] == r["memory_vs_dynamic"] == 1.0
            # fp32 keys and values of every token held: the prompt and all generated tokens but the last.
            tokens = r["context"] + new_tokens - 1
            assert r["kv_bytes"] == 2 * LAYERS * r["batch"] * KV_HEADS * tokens * HEAD_DIM * 4
        elif r["token_match"] < 1:
            assert 0 <= r["first_divergence"] < new_tokens
        if r["cache"].startswith("kivi") and r["context"] == max(contexts):
            assert r["memory_vs_dynamic"] > 3


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_bench_extra_kivi_options_reach_the_cache(assets, tmp_path, capsys):
    model_dir, _ = assets
    common = ["bench", "--model", model_dir, "--contexts", 64, "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 0]
    common += ["--repeats", 1, "--caches", "kivi-dense", *KIVI]
    plain = run_json(common, tmp_path, capsys)["rows"][0]
    wide = run_json([*common, "--kivi-option", "key_bits=4"], tmp_path, capsys)["rows"][0]
    assert wide["cache"] == "kivi-dense 2-bit (key_bits=4)"
    assert wide["kv_bytes"] > plain["kv_bytes"]  # 4-bit key codes instead of 2-bit


@pytest.mark.parametrize(("dtype", "metadata"), [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_the_tools_store_the_metadata_dtype_kivi_cache_chooses(dtype, metadata):
    """No --meta-dtype: the tools' caches follow KiviCache's rule for the model's dtype (bfloat16 scales and zeros
    for a bfloat16 model), as a KiviCache built without the tools would; --meta-dtype still chooses."""
    model = tiny_llama().to(dtype)
    spec = specs.CacheSpec("kivi-fused", 2)
    for options, expected in ((ToolOptions(), metadata), (ToolOptions(meta_dtype="float32"), torch.float32)):
        cache = specs.make_cache(spec, model.config, options)
        model(torch.tensor([[1, 2, 3]]), **cache_argument(cache), use_cache=True)
        assert cache.layers[0].settings.meta_dtype == expected


def test_bench_without_dynamic_or_tqdm_runs_without_ratios_or_bars(assets, tmp_path, capsys, monkeypatch):
    model_dir, _ = assets
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` fails: the tool runs without progress bars
    path = tmp_path / "out.json"
    args = ["bench", "--model", model_dir, "--contexts", 20, "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 0]
    code, _, err = run([*args, "--repeats", 2, "--caches", "kivi-fused", *KIVI, "--json", path], capsys)
    assert code == 0, err
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 1 and len(rows[0]["runs"]) == 2
    assert rows[0]["token_match"] is None and rows[0]["memory_vs_dynamic"] is None


class FailingCache(DynamicCache):
    def update(self, *args, **kwargs):
        raise RuntimeError("packing failed")


@pytest.mark.parametrize("tool", ["bench", "eval-ppl"])
def test_a_failing_third_party_cache_is_reported_and_the_others_run(assets, tmp_path, capsys, monkeypatch, tool):
    model_dir, text = assets
    real_make_cache = side_by_side.make_cache

    def make_cache(spec, *args):
        return FailingCache() if spec.name == "quanto" else real_make_cache(spec, *args)

    for module in (workload, evaluate):  # as if quanto were installed
        monkeypatch.setattr(module, "unavailable_reason", lambda spec: None)
    for module in (side_by_side, evaluate):
        monkeypatch.setattr(module, "make_cache", make_cache)
    args = ["--model", model_dir, "--caches", "dynamic", "quanto", *KIVI]
    if tool == "bench":
        args += ["--contexts", 20, "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 0, "--repeats", 1]
    else:
        args += ["--text", text, "--prefill", 20, "--decode-steps", 4, "--windows", 2]
    payload = run_json([tool, *args], tmp_path, capsys)
    assert [r["cache"] for r in payload["rows"]] == ["dynamic"]
    failures = [s for s in payload["skipped"] if s["reason"] == "failed: RuntimeError: packing failed"]
    assert failures and all(s["cache"] == "quanto 2-bit" for s in failures)


def test_plot_without_matplotlib_is_a_clear_error_before_running(assets, tmp_path, capsys, monkeypatch):
    model_dir, _ = assets
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(["bench", "--model", model_dir, "--plot", tmp_path / "p.png"], capsys)
    assert code == 2 and err == "error: --plot needs matplotlib: pip install matplotlib\n"


# ---------------------------------------------------------------------------------------------------------------
# eval-ppl


def test_eval_ppl_decode_windows_fused_equals_dense(assets, tmp_path, capsys, backend_name):
    model_dir, text = assets
    windows, prefill, steps = 3, 40, 24
    payload = run_json(
        [
            "eval-ppl",
            "--model",
            model_dir,
            "--text",
            text,
            "--eval-mode",
            "decode",
            "--windows",
            windows,
            "--prefill",
            prefill,
            "--decode-steps",
            steps,
            "--caches",
            "dynamic",
            "kivi-fused",
            "kivi-dense",
            "--bits",
            2,
            4,
            *KIVI,
            "--backend",
            backend_name,
        ],  # fmt: skip
        tmp_path,
        capsys,
    )
    rows = {r["cache"]: r for r in payload["rows"]}
    assert list(rows) == ["dynamic", "kivi-fused 2-bit", "kivi-fused 4-bit", "kivi-dense 2-bit", "kivi-dense 4-bit"]
    assert payload["evaluated"] == {"windows": windows, "prefill": prefill, "decode_steps": steps}
    for r in rows.values():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["scored_tokens"] == windows * steps and len(r["window_perplexities"]) == windows
        assert r["window_min"] <= r["window_mean"] <= r["window_max"] and r["window_std"] >= 0
        assert math.isclose(r["perplexity"], math.exp(r["mean_nll"]))
    assert rows["dynamic"]["delta_vs_dynamic"] == 0 and rows["dynamic"]["window_delta_std"] == 0
    for bits in (2, 4):
        fused, dense = rows[f"kivi-fused {bits}-bit"], rows[f"kivi-dense {bits}-bit"]
        assert fused["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-4)
        assert fused["window_perplexities"] == pytest.approx(dense["window_perplexities"], rel=1e-4)
        assert fused["perplexity"] != rows["dynamic"]["perplexity"]  # the quantized history is read
        assert fused["memory_vs_dynamic"] > 1
    # 4 bits are closer to full precision than 2 bits.
    assert abs(rows["kivi-fused 4-bit"]["delta_vs_dynamic"]) < abs(rows["kivi-fused 2-bit"]["delta_vs_dynamic"])


def test_eval_ppl_streaming_with_the_whole_text_in_the_window_equals_dynamic(assets, tmp_path, capsys):
    model_dir, text = assets
    tokens = 48
    common = ["eval-ppl", "--model", model_dir, "--text", text, "--eval-mode", "streaming", "--max-tokens", tokens]
    common += ["--segment-length", 16, "--caches", "dynamic", "kivi-fused", "kivi-dense", "--group-size", 16]
    exact = run_json([*common, "--residual-length", 64], tmp_path, capsys)
    assert exact["evaluated"] == {"tokens": tokens, "segment_length": 16}
    base = exact["rows"][0]
    assert base["scored_tokens"] == tokens - 1 and len(base["window_perplexities"]) == 3
    for r in exact["rows"][1:]:
        assert r["perplexity"] == pytest.approx(base["perplexity"], rel=1e-5)
    quantized = run_json([*common, "--residual-length", 16], tmp_path, capsys)
    assert quantized["rows"][0]["perplexity"] == pytest.approx(base["perplexity"], rel=1e-6)
    for r in quantized["rows"][1:]:
        assert r["perplexity"] != pytest.approx(base["perplexity"], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# bad input: one `error:` line, exit code 2, no JSON


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--contexts", 300], "exceed the model's max_position_embeddings (256)"),
        (["bench", "--contexts", 64, "--bits", 3], "`bits`"),
        (["bench", "--contexts", 64, "--group-size", 24], "`group_size`"),
        (["bench", "--new-tokens", 3, "--warmup", 2], "--new-tokens (3) must exceed --warmup (2) + 1"),
        (["bench", "--contexts", 64, "--batch-sizes", 100, "--text", "TEXT"], "the largest batch x context needs"),
        (["eval-ppl", "--windows", 50, "--prefill", 100, "--decode-steps", 50], "fewer than --windows 50"),
        (["eval-ppl", "--prefill", 200, "--decode-steps", 100], "exceed the model's max_position_embeddings"),
        (["eval-ppl", "--eval-mode", "streaming", "--max-tokens", 300], "exceeds the model's max_position"),
        (["eval-ppl", "--eval-mode", "streaming"], "more tokens than the model's max_position_embeddings"),
        (["eval-ppl", "--text", "/nonexistent/text.txt"], "no such file"),
        (["eval-ppl", "--kivi-option", "no_such_option=1"], "no_such_option"),
    ],
)
def test_bad_input_is_one_error_line_and_no_json(assets, tmp_path, capsys, args, message):
    model_dir, text = assets
    args = [text if a == "TEXT" else a for a in args]
    path = tmp_path / "out.json"
    extra = [] if "--text" in args or args[0] == "bench" else ["--text", text]
    code, out, err = run([*args, *extra, "--model", model_dir, "--json", path, "--no-progress"], capsys)
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert not path.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--caches", "dynamic", "bogus"], "invalid choice: 'bogus'"),
        (["eval-ppl", "--caches", "fp8"], "invalid choice: 'fp8'"),
        (["bench", "--contexts", 0], "must be a positive integer, got '0'"),
        (["bench", "--batch-sizes", "two"], "must be an integer, got 'two'"),
        (["eval-ppl", "--eval-mode", "sliding"], "invalid choice: 'sliding'"),
        (["eval-ppl", "--kivi-option", "sinks"], "expected NAME=VALUE"),
        (["bench", "--kivi-option", "bits=4"], "'bits' is not a --kivi-option: use --bits"),
        (["eval-ppl", "--kivi-option", "attention=dense"], "the cache names choose it"),
        (["bench", "--kivi-option", "device=opencl:cpu"], "'device' is not a --kivi-option: use --sycl-device"),
    ],
)
def test_bad_arguments_are_argparse_errors(tmp_path, capsys, args, message):
    path = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in [*args, "--json", path]])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not path.exists()


def test_a_model_that_cannot_load_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    path = tmp_path / "out.json"
    code, _, err = run(["eval-ppl", "--model", empty, "--text", __file__, "--json", path], capsys)
    assert code == 2 and err.startswith(f"error: cannot load model '{empty}'") and "Traceback" not in err
    assert not path.exists()


def test_a_missing_output_directory_fails_before_running(assets, tmp_path, capsys):
    model_dir, _ = assets
    missing = tmp_path / "missing" / "out.png"
    code, _, err = run(["bench", "--model", model_dir, "--plot", missing], capsys)
    assert code == 2 and "--plot" in err and "does not exist" in err


def test_a_run_that_fails_midway_writes_no_json(assets, tmp_path, capsys, monkeypatch):
    model_dir, _ = assets
    real_run_once, calls = side_by_side.run_once, []

    def failing_run_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # after the warm-up runs and the first measured run
            raise KeyboardInterrupt
        return real_run_once(*args, **kwargs)

    monkeypatch.setattr(side_by_side, "run_once", failing_run_once)
    path = tmp_path / "out.json"
    with pytest.raises(KeyboardInterrupt):
        main(
            ["bench", "--model", str(model_dir), "--contexts", "20", "--batch-sizes", "1", "--new-tokens", "3"]
            + ["--warmup", "0", "--repeats", "1", "--caches", "dynamic", "kivi-dense", *KIVI, "--json", str(path)]
        )
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []


# runpy warns that the module is already imported (by this file): harmless, the tool runs from the fresh copy.
@pytest.mark.filterwarnings("ignore:'kivi_xpu.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("module", ["kivi_xpu.tools.bench", "kivi_xpu.tools.eval_ppl", "kivi_xpu.tools.calibrate"])
def test_module_entry_points_exit_with_the_tool_status(module, tmp_path, capsys, monkeypatch):
    # `python -m kivi_xpu.tools.<tool>`, run in this process (calibrate takes --json as an alias of --output).
    monkeypatch.setattr(sys, "argv", [module, "--model", str(tmp_path), "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot load model") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# --device (where the model runs) and --sycl-device (the SYCL device filter of the KIVI kernels)

# The arguments each tool needs besides --model to get as far as loading the model and building its KIVI caches.
TOOL_ARGS = {
    "bench": ["--contexts", 20, "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 0, "--repeats", 1],
    "eval-ppl": ["--prefill", 20, "--decode-steps", 2, "--windows", 1],
    "calibrate": ["--prefill", 20, "--decode-steps", 2, "--windows", 1],
}
# Where each tool looks up load_model and KiviCache (bench and eval-ppl build their caches in specs).
LOADS_IN = {"bench": workload, "eval-ppl": evaluate, "calibrate": calibrate}
BUILDS_IN = {"bench": specs, "eval-ppl": specs, "calibrate": calibrate}


def tool_args(tool: str, model, text, tmp_path) -> list:
    """The tool's command line up to its model-loading step, writing its JSON (if ever) under ``tmp_path``."""
    output = ["--output" if tool == "calibrate" else "--json", tmp_path / "out.json"]
    texts = [] if tool == "bench" else ["--text", text]
    return [tool, "--model", model, *TOOL_ARGS[tool], *texts, *output, "--no-progress"]


@pytest.mark.parametrize("tool", ["bench", "eval-ppl", "calibrate"])
def test_device_and_dtype_reach_load_model(tool, tmp_path, capsys, monkeypatch):
    loaded = []

    def recording_load_model(name, dtype, device="cpu"):
        loaded.append((name, dtype, device))
        raise ToolError("stopped after load_model")

    monkeypatch.setattr(LOADS_IN[tool], "load_model", recording_load_model)
    args = [*tool_args(tool, "some-model", __file__, tmp_path), "--device", "xpu:1", "--dtype", "bfloat16"]
    code, _, err = run(args, capsys)
    assert code == 2 and err == "error: stopped after load_model\n"
    assert loaded == [("some-model", "bfloat16", "xpu:1")]


def test_load_model_puts_the_model_on_the_device_in_the_dtype(assets):
    model_dir, _ = assets
    model, path = load_model(str(model_dir), "bfloat16", "cpu")
    assert path == str(model_dir) and not model.training
    assert model.device == torch.device("cpu") and model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "tool, device, message",
    [
        ("bench", "gpu", "--device 'gpu' is not a torch device: use a torch device such as cpu, xpu"),
        ("eval-ppl", "level_zero:gpu:0", "(a SYCL device filter such as opencl:cpu goes to --sycl-device)"),
        ("calibrate", "cuda:0", "--device 'cuda:0': this torch"),
        ("bench --curve", "meta", "--device 'meta' holds no data and cannot run a model"),
    ],
)
def test_a_bad_device_is_one_error_line_before_the_model_loads(tool, device, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a machine with a GPU
    missing = tmp_path / "no-such-model"  # the device is checked first: no error about the model
    if tool == "bench --curve":
        args = ["bench", "--curve", "--contexts", 32, "--new-tokens", 3, "--warmup", 1, "--no-progress"]
    else:
        args = tool_args(tool, missing, __file__, tmp_path)
    code, out, err = run([*args, "--device", device], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: --device {device!r}") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("tool", ["bench", "eval-ppl", "calibrate"])
def test_sycl_device_reaches_kivi_cache(tool, assets, tmp_path, capsys, monkeypatch):
    model_dir, text = assets
    built = []

    def recording_kivi_cache(**kwargs):
        built.append(kwargs)
        raise ValueError("stopped at KiviCache")  # every tool reports a KiviCache it cannot build as a ToolError

    monkeypatch.setattr(BUILDS_IN[tool], "KiviCache", recording_kivi_cache)
    args = [*tool_args(tool, model_dir, text, tmp_path), "--sycl-device", "opencl:cpu", "--device", "cpu"]
    code, _, err = run([*args, *([] if tool == "calibrate" else ["--caches", "kivi-dense"])], capsys)
    assert code == 2 and "device='opencl:cpu'" in err and err.endswith("stopped at KiviCache\n"), err
    assert [kwargs["device"] for kwargs in built] == ["opencl:cpu"]


def test_bench_runs_on_the_model_device_with_the_sycl_filter_in_every_kivi_cache(assets, tmp_path, capsys, monkeypatch):
    model_dir, _ = assets
    devices = []

    class RecordingKiviCache(KiviCache):
        def __init__(self, **kwargs):
            devices.append(kwargs["device"])
            super().__init__(**kwargs)

    monkeypatch.setattr(specs, "KiviCache", RecordingKiviCache)
    args = ["bench", "--model", model_dir, *TOOL_ARGS["bench"], "--caches", "dynamic", "kivi-fused", *KIVI]
    # The reference kernels check the filter's form only, so the run needs no SYCL device.
    args += ["--device", "cpu", "--dtype", "bfloat16", "--backend", "reference", "--sycl-device", "opencl:cpu"]
    payload = run_json(args, tmp_path, capsys)
    assert payload["settings"]["device"] == "cpu" and payload["settings"]["dtype"] == "bfloat16"
    assert payload["settings"]["sycl_device"] == "opencl:cpu" and "device" not in payload["settings"]["kivi_options"]
    assert payload["environment"]["kivi_kernels"]["backend"] == "reference"
    assert [r["cache"] for r in payload["rows"]] == ["dynamic", "kivi-fused 2-bit"]
    assert len(devices) >= 3 and set(devices) == {"opencl:cpu"}  # the check, the warm-up run and the measured run


def test_timed_phases_wait_for_the_model_device_only(monkeypatch):
    from kivi_xpu.tools.timing import synchronize

    waited = []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "synchronize", waited.append)
    synchronize(torch.device("cuda:1"))
    synchronize(torch.device("cpu"))  # the CPU's work is done when its call returns
    assert waited == [torch.device("cuda:1")]


# ---------------------------------------------------------------------------------------------------------------
# Wikipedia text


WIKITEXT = """{{Infobox country|name=Testland|capital={{nowrap|Test City}}}}
'''Testland''' is a [[country]] in [[Europe|western Europe]].<ref name="a">{{cite web|url=http://x.org}}</ref> It has
[[File:Map.png|thumb|A map of [[Testland]] with [[river]]s]]a [http://example.org coastline] and [http://x.org] hills.
<!-- a comment -->
{| class="wikitable"
|-
| cell || {| inner table |}
|}
== History ==
* Founded in 1900&nbsp;AD.<ref>Source.</ref>
# Grew ''quickly''.

== See also ==
* [[Other land]]
[[Category:Countries]]
[[de:Testland]]
"""


def test_strip_wiki_markup_keeps_the_prose():
    assert strip_wiki_markup(WIKITEXT) == (
        "Testland is a country in western Europe. It has\n"
        "a coastline and hills.\n\n"
        "History\n"
        "Founded in 1900 AD.\n"
        "Grew quickly."
    )


def test_wiki_articles_skips_redirects_and_other_namespaces():
    page = "<page><title>{t}</title><ns>{ns}</ns>{extra}<revision><text>{body}</text></revision></page>"
    dump = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
        + page.format(t="Kept", ns=0, extra="", body="Some '''bold''' [[text]].")
        + page.format(t="Moved", ns=0, extra='<redirect title="Kept" />', body="#REDIRECT [[Kept]]")
        + page.format(t="Talk:Kept", ns=1, extra="", body="Discussion.")
        + page.format(t="Empty", ns=0, extra="", body="{{stub}}")
        + "</mediawiki>"
    )
    assert wiki_articles(dump.encode()) == [("Kept", "Some bold text.")]


def test_news_text_is_built_once_with_articles_separated_by_blank_lines(tmp_path, monkeypatch):
    downloads = []

    def fake_pip_download(requirement, dest):
        # A wheel holding the corpus as gensim ships it: one article per line (the last without a newline).
        downloads.append(requirement)
        wheel = dest / "gensim-4.4.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(GENSIM_LEE, "First article. Two sentences.\n  Second article.  \n\nThird, caf\u00e9.")
        return wheel

    monkeypatch.setattr(kivi_xpu.assets, "pip_download", fake_pip_download)
    path = news_text(tmp_path / "cache")
    assert downloads == [GENSIM_WHEEL] and path.parent == tmp_path / "cache"
    expected = "First article. Two sentences.\n\nSecond article.\n\nThird, caf\u00e9.\n"
    assert path.read_text(encoding="utf-8") == expected
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no .partial left behind
    assert news_text(tmp_path / "cache") == path and len(downloads) == 1  # cached: no second download


def test_text_shortcuts_resolve_through_the_assets(tmp_path, monkeypatch):
    for name, helper in (("news", "news_text"), ("wikipedia", "wikipedia_text")):
        monkeypatch.setattr(kivi_xpu.assets, helper, lambda name=name: tmp_path / f"{name}.txt")
        assert resolve_text(name) == tmp_path / f"{name}.txt"
    with pytest.raises(ToolError, match="no such file .*wikipedia, news"):
        resolve_text(str(tmp_path / "missing.txt"))


# ---------------------------------------------------------------------------------------------------------------
# bench: StaticCache baseline, machine facts, --contend, --curve


def check_step_ratios(rows):
    """Every row's step speedups equal the Dynamic and Static rows' ms/step of its configuration over its own."""
    for r in rows:
        same = {x["name"]: x for x in rows if (x["context"], x["batch"]) == (r["context"], r["batch"])}
        for baseline in ("dynamic", "static"):
            expected = same[baseline]["ms_per_step"] / r["ms_per_step"]
            assert r[f"step_speedup_vs_{baseline}"] == pytest.approx(expected)
        assert r["ms_per_step"] > 0 and r["kv_check"] == "ok", r


def check_machine_facts(payload, out):
    env = payload["environment"]
    assert set(env["cpu"]) == {"model", "CPU family", "Model", "isa"} and isinstance(env["cpu"]["isa"], list)
    assert env["kivi_kernels"]["backend"] in ("sycl", "reference", "native")
    assert f"CPU: {env['cpu']['model']}; ISA: " in out and f"KIVI kernels: {env['kivi_kernels']['backend']}" in out


def test_bench_static_baseline_machine_facts_and_competitors(assets, tmp_path, capsys):
    model_dir, _ = assets
    path = tmp_path / "out.json"
    args = ["bench", "--model", model_dir, "--contexts", "20,40", "--batch-sizes", 1, "--new-tokens", 4]
    args += ["--warmup", 1, "--repeats", 1, "--caches", "dynamic", "static", "kivi-fused", *KIVI, "--contend", 1]
    code, out, err = run([*args, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    payload = json.loads(path.read_text())
    assert payload["settings"]["contend"] == 1 and "competitor processes (--contend): 1" in out
    check_machine_facts(payload, out)
    rows = payload["rows"]
    assert [(r["context"], r["cache"]) for r in rows] == [
        (c, cache) for c in (20, 40) for cache in ("dynamic", "static", "kivi-fused 2-bit")
    ]
    check_step_ratios(rows)
    for r in rows:
        if r["name"] == "static":  # the same model and prompt as Dynamic: the same greedy tokens
            assert r["token_match"] == 1.0
            # preallocated for context + new tokens (fp32 K and V), plus one 8-byte token counter per layer
            assert r["kv_bytes"] == 2 * LAYERS * KV_HEADS * (r["context"] + 4) * HEAD_DIM * 4 + 8 * LAYERS


def test_competitors_run_during_the_block_and_are_killed_even_on_interrupt():
    from kivi_xpu.tools.timing import competitors

    with pytest.raises(KeyboardInterrupt), competitors(2) as processes:
        assert len(processes) == 2 and all(p.poll() is None for p in processes)
        raise KeyboardInterrupt
    assert all(p.returncode is not None for p in processes)


def test_bench_curve_writes_rows_for_every_context_a_table_and_a_plot(tmp_path, capsys):
    path, plot = tmp_path / "curve.json", tmp_path / "curve.png"
    args = ["bench", "--curve", "--contexts", "32,96", "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 1]
    args += ["--repeats", 1, "--caches", "dynamic", "static", "kivi-fused", "quanto", *KIVI, "--plot", plot]
    code, out, err = run([*args, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    assert out.startswith("| cache |") and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(path.read_text())
    check_machine_facts(payload, out)
    assert payload["curve_model"]["max_position_embeddings"] == 96 + 3 + curve.PART_STEPS and payload["context_fill"]
    assert [s["cache"] for s in payload["skipped"]] == ["quanto 2-bit"]
    rows = payload["rows"]
    assert [(r["context"], r["name"]) for r in rows] == [
        (c, name) for c in (32, 96) for name in ("dynamic", "static", "kivi-fused")
    ]
    check_step_ratios(rows)
    kv = {(r["name"], r["context"]): r["kv_bytes"] for r in rows}
    for name in ("dynamic", "static", "kivi-fused"):
        assert kv[name, 96] > kv[name, 32]


def test_bench_curve_refuses_a_model_or_text(assets, capsys):
    model_dir, _ = assets
    code, _, err = run(["bench", "--curve", "--model", model_dir, "--no-progress"], capsys)
    assert code == 2 and err.startswith("error: --curve runs a tiny random Llama, or a named shape (--model with one")
    assert "llama-3.1-8b" in err


# Named shapes small enough for a test, built by the same code as the public ones (Qwen2's config has no head_dim).
TINY_SHAPE = (LlamaConfig, LlamaForCausalLM, dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, vocab_size=300, tie_word_embeddings=False,
))  # fmt: skip
TINY_QWEN_SHAPE = (Qwen2Config, Qwen2ForCausalLM, dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=300, tie_word_embeddings=False,
))  # fmt: skip


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_public_shape_has_the_dimensions_of_its_config(name):
    config = shapes.shape_config(name, 4096)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim in (64, 128) and config.num_attention_heads % config.num_key_value_heads == 0
    assert config.max_position_embeddings >= 8192
    with pytest.raises(ValueError, match="`name` must be one of"):
        shapes.shape_config("llama-9", 1)


def test_a_shape_config_keeps_only_the_layers_asked_for():
    assert shapes.shape_config("llama-3.2-3b", 4096, layers=2).num_hidden_layers == 2
    assert shapes.shape_config("llama-3.2-3b", 4096).num_hidden_layers == 28
    with pytest.raises(ValueError, match="`layers` must be a positive number"):
        shapes.shape_config("llama-3.2-3b", 4096, layers=0)


@pytest.mark.parametrize("mode", [[], ["--curve"]], ids=["side-by-side", "curve"])
def test_bench_layers_without_a_named_shape_is_refused(mode, assets, capsys):
    model = [] if mode else ["--model", assets[0]]
    code, _, err = run(["bench", *mode, *model, "--layers", 2, "--no-progress"], capsys)
    assert code == 2 and err.startswith("error: --layers builds part of a named shape: --model must be one of")
    assert "llama-3.2-3b" in err


def test_a_shape_model_is_random_finite_and_the_same_at_every_build(monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "tiny-shape", TINY_SHAPE)
    first, second = (shapes.shape_model("tiny-shape", torch.bfloat16) for _ in range(2))
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b) and torch.isfinite(a).all(), name
        assert (a == 1).all() if a.dim() == 1 else a.float().std() > 0.01
    logits = first(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()


@pytest.mark.parametrize("shape", [TINY_SHAPE, TINY_QWEN_SHAPE], ids=["llama", "qwen2"])
def test_bench_on_a_named_shape_runs_the_curve_and_says_where_the_step_goes(shape, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(shapes.SHAPES, "tiny-shape", shape)
    args = ["bench", "--model", "tiny-shape", "--dtype", "bfloat16", "--contexts", 64, "--new-tokens", 3]
    args += ["--warmup", 1, "--repeats", 1, "--caches", "dynamic", "static", "kivi-fused", "--layers", 2, *KIVI]
    payload = run_json([*args, "--no-progress"], tmp_path, capsys)
    assert "tiny-shape shape with random weights" in payload["model"]
    assert payload["curve_model"]["hidden_size"] == 128 and payload["curve_model"]["dtype"] == "bfloat16"
    assert payload["curve_model"]["num_hidden_layers"] == 2  # --layers as given (shape_config's test: fewer layers)
    for row in payload["rows"]:
        assert 0 < row["weights_ms"] and 0 < row["attention_ms"] and row["rest_ms"] is not None
        assert row["weights_ms"] + row["attention_ms"] < row["ms_per_step"] * 3  # shares of one step, not totals
        if row["name"] == "kivi-fused":  # the op's calls in the timed steps: one per layer and step
            assert row["fused_op_calls_per_step"] == 2 and row["fused_op_ms"] > 0 and row["fused_op_gb_per_s"] > 0
        else:
            assert row["fused_op_ms"] is None and row["fused_op_gb_per_s"] is None


# ---------------------------------------------------------------------------------------------------------------
# bench --kv-budget: throughput at equal KV memory

MIB = 1 << 20
BUDGET_CONTEXT, BUDGET_NEW = 48, 5
# DynamicCache of one sequence at its longest (context + the 4 decoded tokens the cache holds at the end), fp32 K and V
DYNAMIC_SEQUENCE = 2 * LAYERS * KV_HEADS * (BUDGET_CONTEXT + BUDGET_NEW - 1) * HEAD_DIM * 4
# StaticCache: preallocated for context + new tokens, plus its 8-byte token counter per layer
STATIC_SEQUENCE = 2 * LAYERS * KV_HEADS * (BUDGET_CONTEXT + BUDGET_NEW) * HEAD_DIM * 4 + 8 * LAYERS


def run_budget(assets, tmp_path, capsys, budget_bytes: float, *extra) -> tuple[dict, str]:
    model_dir, _ = assets
    args = ["bench", "--model", model_dir, "--kv-budget", budget_bytes / MIB, "--contexts", BUDGET_CONTEXT]
    args += ["--new-tokens", BUDGET_NEW, "--warmup", 1, "--repeats", 2, "--caches", "dynamic", "static", "kivi-fused"]
    path = tmp_path / "budget.json"
    code, out, err = run([*args, *KIVI, *extra, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    return json.loads(path.read_text()), out


def test_bench_kv_budget_runs_each_cache_at_the_largest_batch_that_fits(assets, tmp_path, capsys):
    budget = 2.5 * DYNAMIC_SEQUENCE
    plot = tmp_path / "budget.png"
    payload, out = run_budget(assets, tmp_path, capsys, budget, "--plot", plot)
    assert out.startswith("| cache | context | KV budget MiB |") and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check_machine_facts(payload, out)
    rows = {r["name"]: r for r in payload["rows"]}
    assert list(rows) == ["dynamic", "static", "kivi-fused"] and payload["skipped"] == []
    assert rows["dynamic"]["sequence_kv_bytes"] == DYNAMIC_SEQUENCE and rows["dynamic"]["batch"] == 2
    assert rows["static"]["sequence_kv_bytes"] == STATIC_SEQUENCE
    # G=16, R=16: at 52 tokens most of the history is packed, so KIVI fits more sequences than the dense caches
    assert rows["kivi-fused"]["batch"] > rows["dynamic"]["batch"]
    for r in rows.values():
        assert r["budget_bytes"] == int(budget) and not r["batch_capped"]
        assert r["batch"] * r["sequence_kv_bytes"] <= budget < (r["batch"] + 1) * r["sequence_kv_bytes"]
        # measured again at that batch, at the end of the run: within the budget, every storage accounted for
        assert r["kv_bytes"] <= r["batch"] * r["sequence_kv_bytes"] and r["kv_check"] == "ok"
        assert r["rows_match_one_sequence"]
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] * 1000 / r["ms_per_step"])
        assert len(r["runs_tokens_per_s"]) == 2
        assert r["tokens_per_s_vs_dynamic"] == pytest.approx(
            r["decode_tokens_per_s"] / rows["dynamic"]["decode_tokens_per_s"]
        )
        assert r["batch_vs_dynamic"] == r["batch"] / 2
    assert rows["dynamic"]["kv_bytes"] == 2 * DYNAMIC_SEQUENCE  # linear in the batch: the same buffers per row


def test_bench_kv_budget_caps_the_batch_and_skips_caches_that_cannot_hold_one_sequence(assets, tmp_path, capsys):
    payload, out = run_budget(assets, tmp_path, capsys, 100 * DYNAMIC_SEQUENCE, "--max-batch", 3)
    assert all(r["batch"] == 3 and r["batch_capped"] for r in payload["rows"])
    assert "batch capped by --max-batch" in out
    payload, out = run_budget(assets, tmp_path, capsys, 0.9 * DYNAMIC_SEQUENCE)
    skipped = {s["cache"]: s["reason"] for s in payload["skipped"]}
    assert set(skipped) == {"dynamic", "static"} and "more than the budget" in skipped["dynamic"]
    assert [(r["name"], r["tokens_per_s_vs_dynamic"]) for r in payload["rows"]] == [("kivi-fused", None)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-budget", 0], "must be a positive finite number, got '0'"),
        (["--kv-budget", "inf"], "must be a positive finite number, got 'inf'"),
        (["--kv-budget", "lots"], "must be a number, got 'lots'"),
        (["--kv-budget", 10, "--max-batch", 0], "must be a positive integer, got '0'"),
    ],
)
def test_bench_kv_budget_bad_arguments_are_argparse_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *[str(a) for a in args]])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_kv_budget_and_curve_are_different_modes(capsys):
    code, _, err = run(["bench", "--kv-budget", 10, "--curve", "--no-progress"], capsys)
    assert code == 2 and err == "error: --kv-budget and --curve are different benchmarks: pass one of them\n"


# ---------------------------------------------------------------------------------------------------------------
# bench: the machine's read bandwidth and the fused attention op against it


def test_read_bandwidth_streams_a_buffer_beyond_the_last_level_cache():
    measured = machine.read_bandwidth(repeats=2)
    assert math.isfinite(measured["gb_per_s"]) and measured["gb_per_s"] > 0
    assert measured["threads"] == torch.get_num_threads() and measured["repeats"] == 2
    llc = measured["llc_bytes"]
    assert llc is None or llc > 0
    expected = min(max(4 * (llc or 0), machine.MIN_PROBE_BYTES), machine.MAX_PROBE_BYTES)
    assert measured["buffer_bytes"] == expected // 64 * 64 >= 256 << 20


def test_last_level_cache_from_lscpu_without_sysfs(monkeypatch):
    assert machine._size_bytes("32768K") == 32 << 20 and machine._size_bytes("1M") == 1 << 20
    lscpu = "L1d cache:  65536 (2 instances)\nL2 cache:  1048576 (2 instances)\nL3 cache:  33554432 (1 instance)\n"
    monkeypatch.setattr(machine.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(machine.subprocess, "run", lambda *a, **k: type("Done", (), {"stdout": lscpu}))
    assert machine.last_level_cache_bytes() == 32 << 20


def test_lscpu_lines_are_the_model_and_flags_lines_and_empty_without_lscpu(monkeypatch):
    lscpu = ("Architecture:  x86_64\nModel name:  AMD EPYC\nCPU family:  25\nModel:  17\nL2 cache:  1 MiB\n"
             "Flags:  fpu avx2 avx512f\n")  # fmt: skip
    monkeypatch.setattr(machine.subprocess, "run", lambda *a, **k: type("Done", (), {"stdout": lscpu}))
    expected = ["Model name:  AMD EPYC", "CPU family:  25", "Model:  17", "Flags:  fpu avx2 avx512f"]
    assert machine.lscpu_lines() == expected

    def missing(*args, **kwargs):
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(machine.subprocess, "run", missing)
    assert machine.lscpu_lines() == []


def test_fused_op_timer_records_each_layer_call_with_the_bytes_the_layer_holds():
    model = tiny_llama(attn_implementation="kivi")
    cache = KiviCache(config=model.config, group_size=16, residual_length=16)
    original = attention.decode_attention
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 70)), **cache_argument(cache))
        # What each layer holds before the decode step: the step's attention reads the history packed so far (its
        # codes, scales and zeros), and the sinks, the window and the new token exact.
        streams = [(layer.keys_stream, layer.values_stream) for layer in cache.layers]
        packed = [sum(sum(s.packed.nbytes()) for s in kinds) for kinds in streams]
        new_token = 2 * 2 * 32 * 4  # [B, Hkv, 1, D] fp32
        exact = [sum(s.sinks.nbytes() + s.window.nbytes() + new_token for s in kinds) for kinds in streams]
        with fused_op_timer() as calls:
            model(torch.randint(0, 256, (2, 1)), **cache_argument(cache))
    assert attention.decode_attention is original  # unwrapped after the block
    assert len(calls) == model.config.num_hidden_layers and all(c.seconds > 0 for c in calls)
    assert [c.packed_bytes for c in calls] == packed and min(packed) > 0
    assert [c.exact_bytes for c in calls] == exact
    stats = op_stats(calls, steps=1)
    assert stats.calls_per_step == len(calls) and stats.gb_per_s > 0
    assert op_stats([], steps=1) is None


def test_bench_phases_split_the_native_fused_op_calls(assets, tmp_path, capsys):
    pytest.importorskip("kivi_xpu._cpu", reason="--phases times the native kernels")
    model_dir, _ = assets
    path = tmp_path / "out.json"
    args = ["bench", "--model", model_dir, "--contexts", 64, "--batch-sizes", 2, "--new-tokens", 4, "--warmup", 1]
    args += ["--repeats", 2, "--caches", "dynamic", "kivi-fused", "--backend", "native", "--phases", *KIVI]
    code, out, err = run([*args, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["dynamic"]["fused_op_phase_ms"] is None
    phases = rows["kivi-fused"]["fused_op_phase_ms"]
    assert phases["packed_scores"] > 0 and phases["packed_values"] > 0 and phases["softmax"] > 0
    assert phases["key_meta"] + phases["key_factors"] <= phases["packed_scores"]
    header = next(line for line in out.splitlines() if "| thread ms per call |" in line)
    assert "| key products |" in header and "| value factors |" in header
    row = next(line for line in out.splitlines() if line.startswith("| kivi-fused") and line.count("%") == 10)
    spent = [column(phases) for _, column in report.PHASE_COLUMNS]  # each phase's share of their sum
    assert [cell.strip() for cell in row.split("|")[-11:-1]] == [f"{100 * ms / sum(spent):.1f}%" for ms in spent]


def test_bench_phases_say_when_no_native_call_was_timed(assets, capsys):
    model_dir, _ = assets
    args = ["bench", "--model", model_dir, "--contexts", 32, "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 1]
    code, out, err = run([*args, "--repeats", 1, "--caches", "kivi-dense", "--phases", "--no-progress", *KIVI], capsys)
    assert code == 0, err
    assert "--phases: no call of the native fused attention was timed" in out and "thread ms per call" not in out


def test_bench_phases_are_refused_with_kv_budget(assets, capsys):
    code, _, err = run(["bench", "--model", assets[0], "--kv-budget", 10, "--phases", "--no-progress"], capsys)
    assert code == 2 and "not with --kv-budget" in err


def test_bench_curve_phases_report_the_fused_op_its_bandwidth_and_its_phases(tmp_path, capsys):
    pytest.importorskip("kivi_xpu._cpu", reason="--phases times the native kernels")
    path = tmp_path / "curve.json"
    args = ["bench", "--curve", "--contexts", 64, "--batch-sizes", 1, "--new-tokens", 3, "--warmup", 1]
    args += ["--repeats", 1, "--caches", "static", "kivi-fused", "--backend", "native", "--phases", *KIVI]
    code, out, err = run([*args, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    payload = json.loads(path.read_text())
    bandwidth = payload["environment"]["read_bandwidth"]["gb_per_s"]
    rows = {r["name"]: r for r in payload["rows"]}
    assert all(v is None for k, v in rows["static"].items() if k.startswith("fused_op_"))
    fused = rows["kivi-fused"]
    assert fused["fused_op_calls_per_step"] == curve.CURVE_LLAMA["num_hidden_layers"]
    assert fused["fused_op_ms"] > 0 and fused["fused_op_packed_bytes"] > 0 and fused["fused_op_gb_per_s"] > 0
    assert fused["fused_op_bandwidth_fraction"] == pytest.approx(fused["fused_op_gb_per_s"] / bandwidth)
    phases = fused["fused_op_phase_ms"]
    assert phases["packed_scores"] > 0 and phases["packed_values"] > 0 and phases["softmax"] > 0
    # the curve table: the op's ms, GB/s and share of the read bandwidth in the kivi-fused row
    assert "| attn op ms | attn op GB/s | % of read BW |" in out.splitlines()[0]
    share = f"{100 * fused['fused_op_bandwidth_fraction']:.0f}%"
    cells = f"| {fused['fused_op_ms']:.3f} | {fused['fused_op_gb_per_s']:.2f} | {share} |"
    assert any(line.startswith("| kivi-fused") and cells in line for line in out.splitlines())
    # the phases table after it
    assert any("| thread ms per call |" in line and "| key products |" in line for line in out.splitlines())
    row = next(line for line in out.splitlines() if line.startswith("| kivi-fused") and line.count("%") == 10)
    spent = [column(phases) for _, column in report.PHASE_COLUMNS]
    assert [cell.strip() for cell in row.split("|")[-11:-1]] == [f"{100 * ms / sum(spent):.1f}%" for ms in spent]


def test_bench_reports_the_fused_op_time_and_its_share_of_the_read_bandwidth(assets, tmp_path, capsys):
    model_dir, _ = assets
    path = tmp_path / "out.json"
    args = ["bench", "--model", model_dir, "--contexts", 64, "--batch-sizes", 2, "--new-tokens", 4, "--warmup", 1]
    args += ["--repeats", 2, "--caches", "dynamic", "kivi-fused", "kivi-dense", *KIVI]
    code, out, err = run([*args, "--json", path, "--no-progress"], capsys)
    assert code == 0, err
    payload = json.loads(path.read_text())
    bandwidth = payload["environment"]["read_bandwidth"]
    assert math.isfinite(bandwidth["gb_per_s"]) and bandwidth["gb_per_s"] > 0
    assert f"read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s" in out and "| attn op GB/s | % of read BW |" in out
    rows = {r["name"]: r for r in payload["rows"]}
    fused = rows["kivi-fused"]
    assert fused["fused_op_calls_per_step"] == LAYERS
    assert fused["fused_op_ms"] > 0 and fused["fused_op_packed_bytes"] > 0 and fused["fused_op_exact_bytes"] > 0
    assert fused["fused_op_gb_per_s"] > 0
    assert fused["fused_op_bandwidth_fraction"] == pytest.approx(fused["fused_op_gb_per_s"] / bandwidth["gb_per_s"])
    assert all(run["fused_op_ms"] > 0 for run in fused["runs"])
    fields = [f for f in fused if f.startswith("fused_op_")]
    for name in ("dynamic", "kivi-dense"):  # no fused attention op: no figures
        assert all(rows[name][f] is None for f in fields) and all(r["fused_op_ms"] is None for r in rows[name]["runs"])
