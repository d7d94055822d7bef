"""The device-placement rule (:meth:`kivi_xpu.backend.Selection.storage_device`): each layer's packed history and
kernels follow that layer's tensors. XPU devices are named, not used: torch.device("xpu", 1) needs no GPU, and the
mapping to SYCL devices is checked with the runtime lookup replaced."""

import pytest
import torch
from conftest import require_backend, require_sycl
from tiny_models import tiny_llama
from transformers import AutoModelForCausalLM

from kivi_xpu import KiviCache, KiviLayer, runtime
from kivi_xpu.backend import Selection
from kivi_xpu.ops import kernel

REFERENCE = Selection("reference", "test")
NATIVE = Selection("native", "test", device_name="avx2")
SYCL_CPU = Selection("sycl", "test", "opencl:cpu:0", "CPU")
SYCL_GPU = Selection("sycl", "test", "level_zero:gpu:0", "GPU")
CPU, XPU0, XPU1, META = (torch.device(d) for d in ("cpu", "xpu:0", "xpu:1", "meta"))


@pytest.mark.parametrize(
    "selection, layer_device, storage",
    [
        (REFERENCE, CPU, CPU),
        (REFERENCE, XPU1, XPU1),
        (REFERENCE, META, META),
        (NATIVE, CPU, CPU),
        (NATIVE, XPU1, CPU),
        (SYCL_CPU, CPU, CPU),
        (SYCL_CPU, XPU1, CPU),
        (SYCL_GPU, CPU, CPU),
        (SYCL_GPU, XPU0, XPU0),
        (SYCL_GPU, XPU1, XPU1),  # selected GPU 0, layer on GPU 1: the history stays on GPU 1
    ],
)
def test_packed_history_follows_the_rule(selection, layer_device, storage):
    assert selection.storage_device(layer_device) == storage
    assert selection.storage_device(str(layer_device)) == storage


@pytest.mark.parametrize(
    "selection, layer_device",
    [(NATIVE, META), (SYCL_CPU, META), (SYCL_GPU, META), (SYCL_GPU, torch.device("cuda", 0))],
)
def test_devices_the_kernels_cannot_read_are_refused(selection, layer_device):
    with pytest.raises(ValueError, match=f"`layer_device` is {layer_device}"):
        selection.storage_device(layer_device)


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
    with pytest.raises(ValueError, match="`layer_device` is meta"):
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
        tokens.append(model.generate(ids, past_key_values=cache, max_new_tokens=30, do_sample=False)[0].tolist())
        for index, layer in enumerate(cache.layers):
            device = model.model.layers[index].self_attn.k_proj.weight.device
            assert layer.keys_stream.packed.codes.data.device == cache.backend.storage_device(device)
    assert tokens[0] == tokens[1]
