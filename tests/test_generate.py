"""KiviCache inside real transformers models (tiny random configs): generate, beam search, sampling,
teacher-forced logit error against the full-precision cache."""

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kivi_xpu import KiviCache
from kivi_xpu.integration import cache_argument

VOCAB = 256


def tiny_gqa_llama():  # GQA: 4 query heads share 2 kv heads, head_dim 32
    return tiny_llama(seed=None, vocab_size=VOCAB, max_position_embeddings=2048)


def tiny_gpt2():  # MHA, head_dim 32
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=2048, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


MODELS = {"llama-gqa": tiny_gqa_llama, "gpt2-mha": tiny_gpt2}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]()


def kivi(model, backend_name, **kwargs):
    kwargs.setdefault("group_size", 32)
    kwargs.setdefault("residual_length", 64)
    return KiviCache(config=model.config, backend=backend_name, **kwargs)


@torch.no_grad()
def test_greedy_is_token_identical_while_inside_the_residual_window(model, backend_name):
    ids = torch.randint(0, VOCAB, (2, 20))
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    dense = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    cache = kivi(model, backend_name, bits=2)
    quant = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(dense, quant)
    assert cache.get_seq_length() == 59 < 64  # 20 + 40 - 1 tokens went through the cache


@torch.no_grad()
def teacher_forced_logits(model, cache, tokens, prefill):
    out = [model(tokens[:, :prefill], **cache_argument(cache), use_cache=True).logits[:, -1]]
    for t in range(prefill, tokens.shape[1]):
        out.append(model(tokens[:, t : t + 1], **cache_argument(cache), use_cache=True).logits[:, -1])
    return torch.stack(out, dim=1)


def test_logit_error_is_bounded_and_shrinks_with_more_bits(model, backend_name):
    tokens = torch.randint(0, VOCAB, (1, 330))
    reference = teacher_forced_logits(model, DynamicCache(config=model.config), tokens, prefill=150)
    errors = {}
    for bits in (2, 4, 8):
        logits = teacher_forced_logits(model, kivi(model, backend_name, bits=bits), tokens, prefill=150)
        errors[bits] = (logits - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert errors[8] < errors[4] < errors[2]
    assert errors[8] < 0.1 * errors[4] and errors[4] < 0.5 * errors[2]
    assert errors[8] < 1e-2 * scale and errors[2] < 0.25 * scale  # close, not garbage


@torch.no_grad()
def test_beam_search_matches_dynamic_cache_inside_the_window_and_runs_beyond(model, backend_name):
    ids = torch.randint(0, VOCAB, (2, 12))
    kwargs = dict(attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=2, do_sample=False)
    dense = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=30, min_new_tokens=30, **kwargs)
    quant = model.generate(ids, cache=kivi(model, backend_name), max_new_tokens=30, min_new_tokens=30, **kwargs)
    assert torch.equal(dense, quant)  # reorder_cache and the batch expansion are exact
    long = model.generate(
        ids, cache=kivi(model, backend_name, bits=4), max_new_tokens=150, min_new_tokens=150, **kwargs
    )
    assert long.shape == (4, 12 + 150)


@torch.no_grad()
def test_sampling_runs_across_many_flushes(model, backend_name):
    ids = torch.randint(0, VOCAB, (2, 70))
    cache = kivi(model, backend_name, residual_length=32)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        do_sample=True,
        top_k=20,
        max_new_tokens=200,
        min_new_tokens=200,
    )
    assert out.shape == (2, 270)
    assert cache.get_seq_length() == 269
    layer = cache.layers[0]
    # 269 tokens, 4 sinks: keys 32 * floor(265 / 32) = 256 packed, values 265 - 32 = 233
    assert layer.keys_stream.packed.num_tokens == 256 and layer.values_stream.packed.num_tokens == 233


@torch.no_grad()
def test_continuing_a_conversation_appends_many_tokens_onto_the_history(model, backend_name):
    ids = torch.randint(0, VOCAB, (1, 90))
    cache = kivi(model, backend_name, bits=8)
    first = model.generate(ids, cache=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    follow_up = torch.cat([first, torch.randint(0, VOCAB, (1, 45))], dim=1)  # a new user turn of 45 tokens
    second = model.generate(follow_up, cache=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert second.shape[1] == follow_up.shape[1] + 20 and torch.equal(second[:, : follow_up.shape[1]], follow_up)
    assert cache.get_seq_length() == second.shape[1] - 1
    # At 8 bits the continuation agrees with a full-precision cache on the first tokens at least.
    dense = DynamicCache(config=model.config)
    model.generate(ids, cache=dense, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    expected = model.generate(follow_up, cache=dense, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(second[:, : follow_up.shape[1] + 3], expected[:, : follow_up.shape[1] + 3])


@torch.no_grad()
def test_cache_without_config_creates_kivi_layers_on_first_use(model, backend_name):
    ids = torch.randint(0, VOCAB, (1, 20))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30, do_sample=False)
    dense = model.generate(ids, cache=DynamicCache(), **kwargs)
    cache = KiviCache(group_size=32, residual_length=64, backend=backend_name)
    assert torch.equal(model.generate(ids, cache=cache, **kwargs), dense)
    assert len(cache.layers) == model.config.num_hidden_layers and cache.get_seq_length() == 49


@pytest.mark.parametrize("attn", ("sdpa", "kivi"))
def test_a_cache_filled_under_inference_mode_continues_outside_it_and_back(backend_name, attn):
    model = tiny_gqa_llama()
    model.set_attn_implementation(attn)
    ids = torch.randint(0, VOCAB, (1, 41))
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    outs = []
    for first, then in (
        (torch.no_grad, torch.no_grad),
        (torch.inference_mode, torch.no_grad),
        (torch.no_grad, torch.inference_mode),
    ):
        cache = KiviCache(config=model.config, group_size=32, residual_length=32, backend=backend_name)
        with first():
            model(ids[:, :40], **cache_argument(cache))  # the packed history is created here, with spare room
        with then():
            outs.append(model.generate(ids, cache=cache, **kwargs))  # appends into that room
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
