"""The device rule (:meth:`kivi_xpu.backend.Selection.for_device` and ``storage_device``): each layer's kernels and
packed history follow the device of the tensors the model hands it. XPU and CUDA devices are named, not used:
torch.device("xpu", 1) needs no GPU, and the mapping to SYCL devices is checked with the runtime lookup replaced."""

import warnings
from dataclasses import replace

import pytest
import torch
from conftest import require_backend, require_sycl
from tiny_models import tiny_llama
from transformers import AutoModelForCausalLM

from kivi_xpu import KiviCache, KiviLayer, backend, runtime
from kivi_xpu.backend import Selection
from kivi_xpu.ops import kernel
from kivi_xpu.ops.library import _KERNELS

REFERENCE = Selection("reference", "test")
NATIVE = Selection("native", "test", device_name="avx2")
SYCL_CPU = Selection("sycl", "test", "opencl:cpu:0", "CPU")
SYCL_GPU = Selection("sycl", "test", "level_zero:gpu:0", "GPU")
CPU, XPU0, XPU1, META = (torch.device(d) for d in ("cpu", "xpu:0", "xpu:1", "meta"))
CUDA, MPS = torch.device("cuda", 0), torch.device("mps")


def _native_built() -> bool:
    try:
        runtime.load_native_extension()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(
    "selection, layer_device, kernels, storage",
    [
        (REFERENCE, CPU, "reference", CPU),
        (REFERENCE, XPU1, "reference", XPU1),
        (REFERENCE, CUDA, "reference", CUDA),
        (REFERENCE, META, "reference", META),
        (NATIVE, CPU, "native", CPU),
        (NATIVE, CUDA, "reference", CUDA),  # the crash of issue 49: native kernels were handed cuda tensors
        (NATIVE, MPS, "reference", MPS),
        (NATIVE, META, "reference", META),
        (NATIVE, XPU1, "reference", XPU1),  # no SYCL GPU was selected (torch without XPU): never a host copy
        (SYCL_CPU, CPU, "sycl", CPU),
        (SYCL_CPU, CUDA, "reference", CUDA),
        (SYCL_GPU, XPU0, "sycl", XPU0),
        (SYCL_GPU, XPU1, "sycl", XPU1),  # selected GPU 0, layer on GPU 1: the history stays on GPU 1
        (SYCL_GPU, CUDA, "reference", CUDA),
    ],
)
def test_each_layer_gets_the_kernels_and_storage_of_its_device(selection, layer_device, kernels, storage):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the one warning of the reference on cuda/mps)
        for device in (layer_device, str(layer_device)):
            chosen = selection.for_device(device)
            assert chosen.name == kernels
            assert chosen.storage_device(device) == storage


def test_a_cpu_layer_gets_the_native_kernels_when_the_automatic_choice_is_a_gpu():
    chosen = SYCL_GPU.for_device(CPU)
    assert chosen.name == ("native" if _native_built() else "sycl") and chosen.storage_device(CPU) == CPU
    assert replace(SYCL_GPU, requested="sycl").for_device(CPU).name == "sycl"  # asked for: kept


def test_the_reference_on_another_device_warns_once_and_names_it():
    backend._reference_for.cache_clear()
    with pytest.warns(RuntimeWarning, match="layers on cuda use the pure-PyTorch kernels") as caught:
        NATIVE.for_device(CUDA)
        NATIVE.for_device(torch.device("cuda", 1))
    assert len(caught) == 1


@pytest.mark.parametrize(
    "selection, layer_device",
    [
        (replace(NATIVE, requested="native"), META),
        (replace(NATIVE, requested="native"), CUDA),
        (replace(NATIVE, requested="native"), XPU0),
        (replace(SYCL_CPU, requested="sycl"), META),
        (replace(SYCL_CPU, requested="sycl"), XPU0),
        (replace(SYCL_GPU, requested="sycl"), META),
        (replace(SYCL_GPU, requested="sycl"), CUDA),
    ],
)
def test_an_explicit_backend_refuses_devices_its_kernels_cannot_read(selection, layer_device):
    with pytest.raises(ValueError, match=f"`layer_device` is {layer_device}, but backend='{selection.name}'"):
        selection.for_device(layer_device)


def test_a_layer_chooses_again_after_a_reset_on_another_device():
    layer = KiviLayer(backend=NATIVE if _native_built() else REFERENCE, settings=None)
    keys = torch.randn(1, 2, 200, 32)
    layer.update(keys, keys)
    assert layer.backend.name == ("native" if _native_built() else "reference")
    layer.reset()
    layer.update(keys.to("meta"), keys.to("meta"))
    assert layer.backend.name == "reference" and layer.keys_stream.packed.codes.data.device == META


def test_a_model_on_a_device_without_kernels_runs_the_fused_attention_composed_in_torch(monkeypatch):
    """The dispatch of a model on cuda, with CPU tensors standing in: the rule gives the layers the pure-PyTorch
    kernels; the default (fused) attention then runs the reference ``decode_attention`` on the model's device and
    answers as the dense path does. The native kernels must never be called."""
    model = tiny_llama()
    ids = torch.randint(3, 256, (2, 150))
    dense = KiviCache(config=model.config, residual_length=32, attention="dense")
    expected = model.generate(ids, cache=dense, max_new_tokens=12, do_sample=False)

    def native_must_not_run(*args):
        raise AssertionError("a native kernel was called for a layer the rule gives the reference kernels")

    for op, name in list(_KERNELS):
        if name == "native":
            monkeypatch.setitem(_KERNELS, (op, name), native_must_not_run)
    stand_in = backend._reference_for("meta")  # what cuda gets, without its warning
    monkeypatch.setattr(Selection, "for_device", lambda self, device: stand_in)
    cache = KiviCache(config=model.config, residual_length=32)
    out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert all(layer.fused and layer.backend.name == "reference" for layer in cache.layers)
    assert out.tolist() == expected.tolist()


def test_only_a_sycl_gpu_selection_is_a_gpu():
    assert SYCL_GPU.gpu and not SYCL_CPU.gpu and not NATIVE.gpu and not REFERENCE.gpu


def test_each_xpu_device_gets_the_level_zero_gpu_of_its_index():
    assert runtime.gpu_filter(XPU0) == "level_zero:gpu:0"
    assert runtime.gpu_filter(torch.device("xpu", 3)) == "level_zero:gpu:3"
    with pytest.raises(ValueError, match="`device` must be an xpu device, got cpu"):
        runtime.gpu_filter(CPU)


@pytest.fixture
def fake_runtimes(monkeypatch):
    """Replaces the SYCL runtime lookup: records which filters are initialised, returns the filter as the runtime."""
    asked = []

    def sycl_runtime(device=None):
        asked.append(device)
        return device

    monkeypatch.setattr(runtime, "sycl_runtime", sycl_runtime)
    monkeypatch.setattr(runtime, "host_sycl_runtime", lambda: "host")
    runtime._gpu_runtime.cache_clear()
    yield asked
    runtime._gpu_runtime.cache_clear()


def test_sycl_ops_use_the_queue_of_their_tensors_device(fake_runtimes):
    assert runtime.sycl_runtime_for(XPU1) == "level_zero:gpu:1"
    assert runtime.sycl_runtime_for(XPU0) == "level_zero:gpu:0"
    assert runtime.sycl_runtime_for(XPU1) == "level_zero:gpu:1"
    assert runtime.sycl_runtime_for(CPU) == "host"
    assert fake_runtimes == ["level_zero:gpu:1", "level_zero:gpu:0"]  # each initialised once, not per op
    with pytest.raises(ValueError, match="tensors on meta cannot be served by a SYCL device"):
        runtime.sycl_runtime_for(META)


def test_a_missing_gpu_is_named_with_the_devices_that_exist():
    require_sycl()
    if any(d["filter"] == "level_zero:gpu:7" for d in runtime.sycl_devices()):
        pytest.skip("this machine has a Level Zero GPU 7")
    with pytest.raises(ValueError, match="tensors on xpu:7 are served by the SYCL device 'level_zero:gpu:7'"):
        runtime.sycl_runtime_for(torch.device("xpu", 7))


def test_each_layer_keeps_its_history_on_its_own_device():
    cache = KiviCache(backend="reference", residual_length=32)
    for index, device in enumerate(("cpu", "meta")):
        keys = torch.randn(1, 2, 40, 32, device=device)
        out, _ = cache.update(keys, keys, index)
        assert out.device == torch.device(device)
    for layer, device in zip(cache.layers, ("cpu", "meta"), strict=True):
        stream = layer.keys_stream
        assert stream.packed.num_tokens == 32 and stream.packed.codes.data.device == torch.device(device)
        assert stream.window.data.device == torch.device(device)


@pytest.mark.parametrize("backend_name", ["sycl", "native"])  # the reference runs on every device, meta included
def test_kernels_refuse_tensors_they_cannot_read_instead_of_moving_them(backend_name):
    require_backend(backend_name)
    layer = KiviLayer(backend=backend_name)
    keys = torch.randn(1, 2, 40, 32, device="meta")
    with pytest.raises(ValueError, match=f"`layer_device` is meta, but backend='{backend_name}'"):
        layer.update(keys, keys)
    x = torch.randn(1, 2, 64, 32, device="meta")
    with pytest.raises(ValueError, match="`x`"):
        kernel("quantize_keys", backend_name)(x, 32, 2, torch.float16)


def test_quantize_outputs_stay_on_the_input_device(backend_name):
    x = torch.randn(1, 2, 64, 32)
    for op in ("quantize_keys", "quantize_values"):
        outputs = kernel(op, backend_name)(x, 32, 2, torch.float16)
        assert {t.device for t in outputs} == {CPU}


def test_a_device_map_model_keeps_each_layer_history_where_the_rule_puts_it(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu"}
    device_map |= {"model.rotary_emb": "cpu", "lm_head": "cpu"}
    split = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.float32).eval()
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 256, (1, 20))
    tokens = []
    for model in (split, whole):
        cache = KiviCache(config=model.config, residual_length=32)
        tokens.append(model.generate(ids, cache=cache, max_new_tokens=30, do_sample=False)[0].tolist())
        for index, layer in enumerate(cache.layers):
            device = model.model.layers[index].self_attn.k_proj.weight.device
            assert layer.keys_stream.packed.codes.data.device == cache.backend.for_device(device).storage_device(device)
    assert tokens[0] == tokens[1]


def test_info_states_the_rule_for_each_kind_of_device():
    assert backend.device_rule(SYCL_GPU)["xpu"] == SYCL_GPU.describe()
    assert backend.device_rule(NATIVE)["cpu"] == NATIVE.describe()
    assert backend.device_rule(NATIVE)["other (cuda, mps, ...)"] == "pure-PyTorch kernels on that device"
    assert set(backend.device_rule(REFERENCE).values()) == {"pure-PyTorch kernels on that device"}
    explicit = backend.device_rule(replace(NATIVE, requested="native"))
    assert explicit["xpu"].startswith("refused: backend='native'")
    assert explicit["other (cuda, mps, ...)"] == explicit["xpu"]
