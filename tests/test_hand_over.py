"""The update -> attention hand-over of the fused path (kivi_xpu/attention.py): a stale step never breaks an
unrelated forward nor keeps a cache alive, a model that replaces the keys is still refused, and a cache built
without the model's config finds the fused path by itself."""

import gc
import weakref

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache

from kivi_xpu import KiviCache, attention
from kivi_xpu.integration import cache_argument


def kivi_model():
    model = tiny_llama()
    model.set_attn_implementation("kivi")
    return model


def logits(model, ids, cache):
    with torch.no_grad():
        return model(ids, **cache_argument(cache)).logits


def filled_cache(model, **kwargs):
    cache = KiviCache(group_size=16, residual_length=32, backend="reference", **kwargs)
    logits(model, torch.randint(1, 256, (1, 40)), cache)
    return cache


def test_a_manual_update_without_attention_does_not_break_the_next_unrelated_forward():
    model = kivi_model()
    ids = torch.randint(1, 256, (1, 12))
    expected = logits(model, ids, DynamicCache(config=model.config))
    cache = filled_cache(model, config=model.config)
    states = torch.randn(1, 2, 1, 32)
    cache.update(states, states, 0)  # a fused decode step whose attention never runs
    torch.testing.assert_close(logits(model, ids, DynamicCache(config=model.config)), expected)
    assert attention.pending_step() is None
    logits(model, ids[:, :1], cache)  # and the cache itself goes on (its layer 0 holds one token more)
    assert cache.layers[0].get_seq_length() == cache.layers[1].get_seq_length() + 1


def test_an_exception_between_update_and_attention_leaves_nothing_behind():
    model = kivi_model()
    cache = filled_cache(model, config=model.config)
    states = torch.randn(1, 2, 1, 32)
    with pytest.raises(KeyError):
        keys, values = cache.update(states, states, 0)
        raise KeyError("the model failed after update")
    # `keys` (the 5-token exact tail) is still alive here; 6 tokens: not the contrived same-shape case of the docs
    ids = torch.randint(1, 256, (1, 6))
    torch.testing.assert_close(
        logits(model, ids, DynamicCache(config=model.config)),
        logits(model, ids, DynamicCache(config=model.config)),
    )


def test_a_stale_step_keeps_neither_the_cache_nor_its_buffers_alive():
    model = kivi_model()
    cache = filled_cache(model, config=model.config)
    states = torch.randn(1, 2, 1, 32)
    cache.update(states, states, 0)  # the returned tails are dropped at once
    pending = attention.pending_step()
    assert pending is not None and pending.fused and pending.inputs is None  # no packed buffers held
    codes = weakref.ref(cache.layers[0].keys_stream.packed.codes.data)
    layer, cache_ref = weakref.ref(cache.layers[0]), weakref.ref(cache)
    del cache
    gc.collect()
    assert layer() is None and cache_ref() is None and codes() is None


def test_a_model_that_replaces_the_keys_between_update_and_attention_is_still_refused():
    model = kivi_model()
    cache = filled_cache(model, config=model.config)
    module = model.model.layers[0].self_attn
    states = torch.randn(1, 2, 1, 32)
    keys, values = cache.update(states, states, 0)
    query = torch.randn(1, 4, 1, 32)
    with pytest.raises(RuntimeError, match="transforms them in between"):
        attention.kivi_attention_forward(module, query, keys * 2, values, None)
    keys, values = cache.update(states, states, 0)
    with pytest.raises(RuntimeError, match="transforms them in between"):
        attention.kivi_attention_forward(module, query, keys.clone(), values.clone(), None)


@pytest.mark.parametrize("config", ("none", "copy"))
def test_a_cache_without_the_models_config_uses_the_fused_attention(config):
    model = kivi_model()
    other = type(model.config)(**model.config.to_dict())  # another config object: it says sdpa
    other._attn_implementation = "sdpa"
    kwargs = {} if config == "none" else {"config": other}
    cache = KiviCache(group_size=16, residual_length=32, backend="reference", **kwargs)
    reference = KiviCache(config=model.config, group_size=16, residual_length=32, backend="reference")
    ids = torch.randint(1, 256, (1, 50))
    with torch.no_grad():
        out = model.generate(ids, cache=cache, do_sample=False, max_new_tokens=20, min_new_tokens=20)
        expected = model.generate(ids, cache=reference, do_sample=False, max_new_tokens=20, min_new_tokens=20)
    assert torch.equal(out, expected)
    assert all(layer.fused for layer in cache.layers)
    states = torch.randn(1, 2, 1, 32)
    keys, _ = cache.update(states, states, 0)
    assert keys.shape[2] < cache.get_seq_length()  # a fused step: only the exact tail is returned
    model.set_attn_implementation("sdpa")  # and it still follows the model's attention implementation
    keys, _ = cache.update(states, states, 0)
    assert keys.shape[2] == cache.get_seq_length()
