"""A representative slice of transformers' own generation-mode expectations (its tests/generation/test_utils.py:
``_check_generate_outputs`` / ``_check_past_key_values_for_generate`` after greedy, beam and assisted generation
with ``return_dict_in_generate=True, use_cache=True``, ``test_past_key_values_format``,
``test_generate_continue_from_past_key_values``, ``test_left_padding_compatibility``, the prompt-cache reuse of its
documentation), run with a KiviCache wherever ``generate`` builds its cache (``cache_implementation="kivi"``), on
tiny random models of three architectures, with the process's default backend.

Two windows: ``WIDE`` holds every token in full precision, so everything must equal ``DynamicCache`` exactly;
``SHORT`` quantizes most of the history, so only the formats and counts are checked."""

import copy

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from kivi_xpu import KiviCache
from kivi_xpu.integration import cache_argument

VOCAB, PROMPT, NEW = 256, 7, 20
WIDE = {"group_size": 16, "residual_length": 64}  # PROMPT + NEW tokens never leave the window
SHORT = {"group_size": 16, "residual_length": 16}


def tiny_gpt2():  # MHA, no num_key_value_heads / head_dim in its config
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def tiny_qwen2():
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


MODELS = {"llama": lambda: tiny_llama(pad_token_id=0), "gpt2": tiny_gpt2, "qwen2": tiny_qwen2}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]()


def prompt(batch=2, length=PROMPT):
    ids = torch.randint(1, VOCAB, (batch, length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model, inputs, window=SHORT, **kwargs):
    """``generate`` with its own KiviCache (``window=None``: its own DynamicCache), dict outputs, cache on."""
    cache = {} if window is None else {"cache_implementation": "kivi", "cache_config": window}
    kwargs = {"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW, "use_cache": True} | kwargs
    with torch.no_grad():
        return model.generate(
            **inputs, **cache, **kwargs, return_dict_in_generate=True, output_scores=True, output_logits=True
        )


def check_past_key_values(cache, batch, length, config):
    """transformers' ``_check_past_key_values_for_generate``: every layer's keys and values are
    ``[batch, kv_heads, length, head_dim]``; also through iteration, as DataParallel reads them."""
    assert isinstance(cache, KiviCache)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = [(batch, heads, length, head_dim)] * config.num_hidden_layers
    assert [layer.keys.shape for layer in cache.layers] == expected
    assert [layer.values.shape for layer in cache.layers] == expected
    assert [(k.shape, v.shape) for k, v, _ in cache] == [(e, e) for e in expected]
    assert cache.get_seq_length() == length


def check_generate_outputs(out, batch, config, sequences=None):
    """transformers' ``_check_generate_outputs`` for a decoder-only model with ``use_cache=True``."""
    sequences = batch if sequences is None else sequences
    assert out.sequences.shape == (sequences, PROMPT + NEW)
    assert len(out.scores) == len(out.logits) == NEW
    assert all(s.shape == (batch, config.vocab_size) for s in out.scores + out.logits)
    check_past_key_values(out.past_key_values, batch, PROMPT + NEW - 1, config)  # the last token is not fed


def assert_same_generation(out, expected):
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_greedy_dict_outputs_use_cache(model):
    inputs = prompt()
    check_generate_outputs(generate(model, inputs), 2, model.config)
    wide = generate(model, inputs, WIDE)
    check_generate_outputs(wide, 2, model.config)
    assert_same_generation(wide, generate(model, inputs, None))


def test_beam_search_dict_outputs_use_cache(model):
    inputs, beams = prompt(), {"num_beams": 2, "num_return_sequences": 2, "length_penalty": 2.0}
    out = generate(model, inputs, **beams)
    check_generate_outputs(out, 2 * 2, model.config, sequences=2 * 2)  # the cache holds batch x beams rows
    assert out.sequences_scores.shape == (4,) and out.beam_indices.shape[0] == 4
    wide, dynamic = generate(model, inputs, WIDE, **beams), generate(model, inputs, None, **beams)
    assert torch.equal(wide.sequences, dynamic.sequences)
    torch.testing.assert_close(wide.sequences_scores, dynamic.sequences_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("assistance", ("assistant_model", "prompt_lookup_num_tokens"))
def test_assisted_decoding_matches_greedy_search(model, assistance):
    inputs = prompt(batch=1)
    kwargs = {"assistant_model": model} if assistance == "assistant_model" else {"prompt_lookup_num_tokens": 2}
    out = generate(model, inputs, **kwargs)
    check_generate_outputs(out, 1, model.config)
    assert_same_generation(generate(model, inputs, WIDE, **kwargs), generate(model, inputs, None))


@pytest.mark.parametrize("window", (SHORT, WIDE), ids=("short", "wide"))
def test_past_key_values_format(model, window):
    cache = KiviCache(config=model.config, **window)
    inputs = prompt(length=30)
    with torch.no_grad():
        out = model(**inputs, **cache_argument(cache), use_cache=True)
    assert out.past_key_values is cache
    check_past_key_values(cache, 2, 30, model.config)
    if window is WIDE:
        expected = DynamicCache(config=model.config)
        with torch.no_grad():
            model(**inputs, **cache_argument(expected), use_cache=True)
        for (k, v, _), (dk, dv, _) in zip(cache, expected, strict=True):
            assert torch.equal(k, dk) and torch.equal(v, dv)


@pytest.mark.parametrize("window", (SHORT, WIDE), ids=("short", "wide"))
def test_generate_continue_from_past_key_values(model, window):
    """Generating 3 tokens, then 4 more from the returned cache, gives the 7 tokens of one call (the cache holds
    the same tokens in both cases, split by the same rule)."""
    inputs = prompt()
    kwargs = {"max_new_tokens": 7, "min_new_tokens": 7}
    whole = generate(model, inputs, window, **kwargs)
    first = generate(model, inputs, window, max_new_tokens=3, min_new_tokens=3)
    continued_inputs = {"input_ids": first.sequences, "attention_mask": torch.ones_like(first.sequences)}
    with torch.no_grad():
        continued = model.generate(
            **continued_inputs, cache=first.past_key_values, do_sample=False, max_new_tokens=4,
            min_new_tokens=4, return_dict_in_generate=True,
        )  # fmt: skip
    assert torch.equal(continued.sequences, whole.sequences)
    assert continued.past_key_values.get_seq_length() == PROMPT + 7 - 1


@pytest.mark.parametrize("window", (SHORT, WIDE), ids=("short", "wide"))
def test_continuing_from_a_deep_copied_prompt_cache(model, window):
    """The prompt-reuse recipe of transformers' documentation: one cache holding a shared prefix, deep-copied for
    each continuation; the prefix cache stays untouched and each copy answers as a fresh cache would (within the
    window exactly; with quantization the prefix is read from its codes, so only the shapes are compared)."""
    prefix = prompt(batch=1, length=40)
    prompt_cache = KiviCache(config=model.config, **window)
    with torch.no_grad():
        model(**prefix, **cache_argument(prompt_cache))
    held = [(k.clone(), v.clone()) for k, v, _ in prompt_cache]
    for _ in range(2):
        ids = torch.cat([prefix["input_ids"], torch.randint(1, VOCAB, (1, 5))], dim=1)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            out = model.generate(
                **inputs, cache=copy.deepcopy(prompt_cache), do_sample=False, max_new_tokens=5,
                min_new_tokens=5, return_dict_in_generate=True,
            )  # fmt: skip
        check_past_key_values(out.past_key_values, 1, 40 + 5 + 5 - 1, model.config)
        if window is WIDE:
            fresh = KiviCache(config=model.config, **window)
            with torch.no_grad():
                expected = model.generate(**inputs, cache=fresh, do_sample=False, max_new_tokens=5, min_new_tokens=5)
            assert torch.equal(out.sequences, expected)
    for (k, v, _), (hk, hv) in zip(prompt_cache, held, strict=True):
        assert torch.equal(k, hk) and torch.equal(v, hv)
    check_past_key_values(prompt_cache, 1, 40, model.config)


def test_left_padding_compatibility(model):
    """Inside the window, left padding changes nothing of the last token's logits (as with DynamicCache)."""
    ids = torch.randint(1, VOCAB, (2, 10))
    mask = torch.ones_like(ids)
    padded_ids = torch.cat([torch.zeros(2, 4, dtype=torch.long), ids], dim=1)
    padded_mask = torch.cat([torch.zeros(2, 4, dtype=torch.long), mask], dim=1)
    position_ids = (padded_mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with torch.no_grad():
        for i, m, p in ((ids, mask, None), (padded_ids, padded_mask, position_ids)):
            cache = KiviCache(config=model.config, **WIDE)
            extra = {} if p is None else {"position_ids": p}
            logits.append(model(input_ids=i, attention_mask=m, **cache_argument(cache), **extra).logits[:, -1])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
