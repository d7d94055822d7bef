"""A KiviCache survives copy.deepcopy, pickle and torch.save / torch.load: identical state, identical continued
generation, and the attention hand-over slot is never part of what is copied."""

import copy
import importlib.util
import io
import pickle
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama

from kivi_xpu import KiviCache, KiviLayer, KiviSettings, attention, storage
from kivi_xpu.backend import select


def torch_saved(cache):
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda cache: pickle.loads(pickle.dumps(cache)),
    "torch.save": torch_saved,
}


def require_picklable_selection(backend_name):
    """The copies hold the cache's backend Selection, which must pickle (a frozen dataclass of names)."""
    try:
        pickle.dumps(select(backend_name))
    except (TypeError, pickle.PicklingError) as error:
        pytest.skip(f"kivi_xpu.backend.Selection does not pickle yet: {error}")


def state(cache: KiviCache) -> dict:
    """Everything the KIVI layers store, as comparable tensors and values."""
    out = {"layers": len(cache.layers), "settings": cache.settings, "backend": cache.backend.name}
    for index, layer in enumerate(cache.layers):
        out.update(layer_state(layer, f"{index}."))
    return out


def layer_state(layer: KiviLayer, prefix: str = "") -> dict:
    """Everything one KIVI layer stores, as comparable tensors and values."""
    assert isinstance(layer, KiviLayer)
    out = {f"{prefix}config": (layer.settings, layer.backend.name, layer.attention, layer.record_past)}
    out[f"{prefix}length"] = layer.get_seq_length()
    for kind, stream in zip(("keys", "values"), layer._streams(), strict=False):  # none before an update
        at = f"{prefix}{kind}"
        out[f"{at}.sinks"], out[f"{at}.window"] = stream.sinks.view(), stream.window.view()
        out[f"{at}.count"] = stream.packed.num_tokens
        for name, buffer in zip(("codes", "scales", "zeros"), stream.packed.buffers(), strict=True):
            out[f"{at}.{name}"] = buffer.view()
    return out


def assert_same_state(a: KiviCache, b: KiviCache) -> None:
    assert_same(state(a), state(b))


def assert_same(sa: dict, sb: dict) -> None:
    assert sa.keys() == sb.keys()
    for name, value in sa.items():
        if isinstance(value, torch.Tensor):
            assert value.shape == sb[name].shape and value.dtype == sb[name].dtype, name
            assert torch.equal(value, sb[name]), name
            assert value.data_ptr() != sb[name].data_ptr() or value.numel() == 0, f"{name} is shared, not copied"
        else:
            assert value == sb[name], name


def greedy(model, ids, cache, new_tokens):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("attn", ("sdpa", "kivi"))  # dense keys/values returned, or the fused hand-over
@pytest.mark.parametrize("filled", (False, True), ids=("empty", "filled"))
def test_a_copied_cache_continues_generation_token_for_token(backend_name, how, attn, filled):
    require_picklable_selection(backend_name)
    model = tiny_llama(pad_token_id=0)
    model.set_attn_implementation(attn)
    cache = KiviCache(config=model.config, group_size=16, residual_length=32, sink_tokens=2, backend=backend_name)
    ids = torch.randint(1, 256, (2, 45))
    if filled:  # 45 + 40 tokens: several key blocks and a value history packed, recording on
        cache.activate_past_recording()
        ids = greedy(model, ids, cache, 40)
        assert cache.layers[0].keys_stream.packed.num_tokens > 0
    copied = COPIES[how](cache)
    assert copied is not cache and copied.layers[0] is not cache.layers[0]
    assert_same_state(cache, copied)
    follow_up = torch.cat([ids, torch.randint(1, 256, (2, 7))], dim=1)  # a new turn onto the history
    original_out = greedy(model, follow_up, cache, 50)
    copied_out = greedy(model, follow_up, copied, 50)
    assert torch.equal(original_out, copied_out)
    assert_same_state(cache, copied)  # and they remain independent twins


@pytest.mark.parametrize("how", COPIES)
def test_a_config_less_cache_copies_with_its_lazily_created_layers(how):
    require_picklable_selection("reference")
    cache = KiviCache(group_size=16, residual_length=32, backend="reference")
    states = torch.randn(1, 2, 50, 32)
    cache.update(states, states, 0)
    copied = COPIES[how](cache)
    assert_same_state(cache, copied)
    for c in (cache, copied):
        c.update(states, states, 1)  # the copy creates its own new layers
    assert_same_state(cache, copied)
    assert len(copied.layers) == 2 and copied.layers[1] is not cache.layers[1]


@pytest.mark.parametrize("how", COPIES)
def test_the_attention_hand_over_is_never_copied(how):
    require_picklable_selection("reference")
    model = tiny_llama()
    model.set_attn_implementation("kivi")
    cache = KiviCache(config=model.config, group_size=16, residual_length=32, backend="reference")
    states = torch.randn(1, 2, 40, 32)
    cache.update(states, states, 0)
    tails = cache.update(states[:, :, :1], states[:, :, :1], 0)  # a fused decode step: the inputs wait in the slot
    handed = attention.pending_step()
    assert handed is not None and handed.inputs is not None
    size_with_slot = len(pickle.dumps(cache))
    copied = COPIES[how](cache)
    assert attention.pending_step() is handed  # copying neither took nor duplicated it
    del tails  # the step is released
    assert attention.pending_step().inputs is None
    assert len(pickle.dumps(cache)) == size_with_slot
    assert_same_state(cache, copied)


def test_a_pickle_records_its_storage_format_and_another_one_is_refused_by_name():
    layer = KiviLayer(KiviSettings(2, 16, 32, preset="paper"), select("reference"))
    layer.update(torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
    saved = pickle.dumps(layer)
    assert layer.__getstate__()["storage_format"] == storage.STORAGE_FORMAT
    loaded = pickle.loads(saved)
    assert torch.equal(loaded.keys_stream.packed.codes.view(), layer.keys_stream.packed.codes.view())
    # a pickle from before the format was recorded reads as format 1
    legacy = KiviLayer.__new__(KiviLayer)
    legacy.__setstate__({k: v for k, v in layer.__getstate__().items() if k != "storage_format"})
    assert torch.equal(legacy.values_stream.packed.codes.view(), layer.values_stream.packed.codes.view())
    newer = KiviLayer.__new__(KiviLayer)
    with pytest.raises(ValueError, match=r"storage format 2; this kivi-xpu reads format 1"):
        newer.__setstate__({**layer.__getstate__(), "storage_format": 2})


def test_a_pickle_of_kivi_xpu_at_bc2f283_loads_and_continues_as_a_new_cache():
    """Layers pickled before the streams became one class per kind (tests/data/make_legacy_pickle.py, run at
    bc2f283) load as KeyStream / ValueStream with their codecs, hold what a layer of today fed the same tokens holds,
    and go on exactly as it does."""
    data = Path(__file__).parent / "data"
    spec = importlib.util.spec_from_file_location("make_legacy_pickle", data / "make_legacy_pickle.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    prompt, steps = maker.legacy_inputs()
    for old in pickle.loads((data / "kivi_layers_bc2f283.pt").read_bytes()):
        new = KiviLayer(old.settings, backend="reference", attention="dense")
        new.update(*prompt)
        for k, v in steps:
            new.update(k, v)
        assert [type(s).__name__ for s in old._streams()] == ["KeyStream", "ValueStream"]
        assert repr(old.keys_stream.codec) == repr(new.keys_stream.codec)
        assert old.values_stream.packed.layout == new.values_stream.packed.layout
        assert not hasattr(old.keys_stream.packed, "legacy")
        assert_same(layer_state(old), layer_state(new))
        g = torch.Generator().manual_seed(1)
        for _ in range(40):  # past a key block and the value window's moves
            k, v = (torch.randn(2, 2, 1, 32, generator=g) for _ in range(2))
            got, expected = old.update(k, v), new.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert_same(layer_state(old), layer_state(new))
