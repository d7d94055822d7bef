"""Quantization-aware training: the one-call QAT forward against a real token-by-token decode with KiviCache, its
straight-through gradient against a literal per-decode-step implementation, and its bad-input errors."""

import pytest
import torch
from tiny_models import tiny_llama
from transformers import AttentionInterface, DynamicCache, Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv

from kivi_xpu import KiviCache, KiviSettings
from kivi_xpu.integration import cache_argument
from kivi_xpu.ops import reference as ref
from kivi_xpu.qat import QAT_ATTENTION_NAME, decode_read_masks, fake_quantized_states, kivi_qat, qat_attention
from kivi_xpu.rotation import ROTATIONS, rotate, rotation_matrix, unrotate

VOCAB, LENGTH = 101, 70


def llama(**overrides):
    """2 layers, 4 query heads over 2 kv heads (GQA), head_dim 16."""
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, head_dim=16)
    return tiny_llama(seed=None, **(args | overrides))


def qwen2(**overrides):
    """Qwen2-like (qkv bias), 4 query heads over a single kv head (MQA), head_dim 16."""
    args = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    return Qwen2ForCausalLM(Qwen2Config(**(args | overrides))).eval()


# With R = 16 and 70 tokens, several key blocks flush and the value window slides across most of the sequence.
SETTINGS = {
    "paper-small-R": dict(group_size=8, residual_length=16),
    "sinks": dict(group_size=8, residual_length=16, sink_tokens=5),
    "K4V2": dict(group_size=8, residual_length=16, key_bits=4, value_bits=2, sink_tokens=2),
    "separate-groups": dict(residual_length=16, key_group_size=4, value_group_size=16),
    "per-layer": dict(
        group_size=8,
        residual_length=16,
        layer_overrides=[{"bits": 4, "sink_tokens": 3}, {"residual_length": 24, "value_group_size": 4}],
    ),
    "fp32-meta-8bit-values": dict(residual_length=32, group_size=16, value_bits=8, meta_dtype=torch.float32),
}


def streaming_logits(model, input_ids, cache, attention_mask=None, prefill=1):
    """Logits of a prefill of ``input_ids[:, :prefill]`` into ``cache``, then a token-by-token decode of the rest."""
    steps = []
    with torch.no_grad():
        for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, input_ids.shape[1])]:
            kwargs = {}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[:, :end]
                kwargs["position_ids"] = (attention_mask[:, :end].cumsum(-1) - 1).clamp(min=0)[:, start:end]
            out = model(input_ids[:, start:end], **cache_argument(cache), use_cache=True, **kwargs)
            steps.append(out.logits)
    return torch.cat(steps, dim=1)


def qat_logits(model, input_ids, attention_mask=None, **options):
    kwargs = {}
    if attention_mask is not None:
        kwargs = dict(attention_mask=attention_mask, position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad(), kivi_qat(model, **options):
        return model(input_ids, **kwargs).logits


# Every setting on both models through the dense path (SDPA on dequantized states); the fused KIVI attention on the
# GQA Llama for every setting and on the MQA Qwen2 for two (it shares the dequantization with the dense path).
CASES = [(make_model, name, False) for make_model in (llama, qwen2) for name in SETTINGS]
CASES += [(llama, name, True) for name in SETTINGS] + [(qwen2, "sinks", True), (qwen2, "per-layer", True)]


@pytest.mark.parametrize(
    "make_model, name, fused",
    CASES,
    ids=[f"{m.__name__}-{name}-{'fused' if fused else 'dense'}" for m, name, fused in CASES],
)
def test_qat_forward_equals_streaming_decode(backend_name, make_model, name, fused):
    model = make_model()
    options = SETTINGS[name]
    input_ids = torch.randint(0, VOCAB, (3, LENGTH))
    cache = KiviCache(config=model.config, backend=backend_name, attention="auto", **options)
    if fused:
        model.set_attn_implementation("kivi")
    expected = streaming_logits(model, input_ids, cache)
    model.set_attn_implementation("sdpa")
    got = qat_logits(model, input_ids, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    # Not trivially equal: the cache's noise moves the logits well beyond that tolerance.
    with torch.no_grad():
        exact = model(input_ids).logits
    assert (exact - expected).abs().max() > 1e-3


def test_qat_forward_equals_streaming_decode_of_a_left_padded_batch():
    model = llama()
    options = SETTINGS["sinks"]
    input_ids = torch.randint(0, VOCAB, (3, LENGTH))
    attention_mask = torch.ones(3, LENGTH, dtype=torch.long)
    attention_mask[1, :9] = 0
    attention_mask[2, :30] = 0  # padding crosses a key block boundary
    cache = KiviCache(config=model.config, backend="reference", **options)
    expected = streaming_logits(model, input_ids, cache, attention_mask)
    got = qat_logits(model, input_ids, attention_mask, **options)
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("prefill", (5, 21, 40))
def test_qat_with_a_prompt_prefill_equals_prefill_then_decode(prefill):
    model = llama()
    options = SETTINGS["sinks"]
    input_ids = torch.randint(0, VOCAB, (2, LENGTH))
    cache = KiviCache(config=model.config, backend="reference", **options)
    expected = streaming_logits(model, input_ids, cache, prefill=prefill)
    got = qat_logits(model, input_ids, prefill_length=prefill, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    if prefill > 5 + 16:  # a token-by-token decode reads quantized keys/values within the first `prefill` tokens
        assert (got - qat_logits(model, input_ids, **options)).abs().max() > 1e-3


def test_sliding_window_layers_stay_exact_as_in_the_cache(backend_name):
    # Layer 0 full attention (KIVI), layer 1 sliding window of 20 (a DynamicSlidingWindowLayer in the cache).
    model = qwen2(use_sliding_window=True, sliding_window=20, max_window_layers=1)
    options = dict(group_size=8, residual_length=16, sink_tokens=1)
    cache = KiviCache(config=model.config, backend=backend_name, **options)
    assert [type(layer).__name__ for layer in cache.layers] == ["KiviLayer", "DynamicSlidingWindowLayer"]
    input_ids = torch.randint(0, VOCAB, (2, LENGTH))
    expected = streaming_logits(model, input_ids, cache)
    qat = kivi_qat(model, **options)
    assert qat.layer_settings[1] is None
    got = qat_logits(model, input_ids, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def test_qat_takes_the_settings_of_a_given_cache():
    model = llama()
    options = SETTINGS["per-layer"]
    cache = KiviCache(config=model.config, backend="reference", **options)
    qat = kivi_qat(model, cache)
    assert qat.layer_settings == tuple(layer.settings for layer in cache.layers)
    assert qat.layer_settings[0].key_bits == 4 and qat.layer_settings[1].residual_length == 24
    input_ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad(), qat:
        got = model(input_ids).logits
    torch.testing.assert_close(got, qat_logits(model, input_ids, **options), rtol=0, atol=0)


def test_qat_equals_the_exact_forward_when_nothing_is_quantized():
    model = llama()
    input_ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        exact = model(input_ids).logits
    # R >= n - S: no decode step of a 40-token sequence reads anything quantized.
    torch.testing.assert_close(qat_logits(model, input_ids, group_size=8, residual_length=40), exact)
    torch.testing.assert_close(qat_logits(model, input_ids, group_size=8, residual_length=32, sink_tokens=8), exact)
    assert (qat_logits(model, input_ids, group_size=8, residual_length=16) - exact).abs().max() > 1e-3


def test_decode_read_masks_follow_the_streaming_counts():
    settings = KiviSettings(group_size=4, residual_length=8, sink_tokens=2)
    key_mask, value_mask = decode_read_masks(settings, 30)
    for t in range(30):
        # At query t's decode step the cache held t tokens: keys [2, 2 + 8*floor((t-2)/8)), values [2, t - 8).
        keys = [j for j in range(30) if key_mask[t, j]]
        values = [j for j in range(30) if value_mask[t, j]]
        assert keys == list(range(2, 2 + max(0, t - 2) // 8 * 8))
        assert values == list(range(2, max(2, t - 8)))
    assert not key_mask[:10].any() and key_mask[10, 2:10].all() and not key_mask[10, 10]
    prefill_keys, prefill_values = decode_read_masks(settings, 30, prefill_length=20)
    assert not prefill_keys[:20].any() and not prefill_values[:20].any()
    assert torch.equal(prefill_keys[20:], key_mask[20:]) and torch.equal(prefill_values[20:], value_mask[20:])
    assert torch.equal(decode_read_masks(settings, 30, prefill_length=1)[0], key_mask)


def decode_step_by_step(query, key, value, settings, scaling):
    """The literal decode: for each query position t, the keys/values the cache holds at that step (t tokens before
    the update, plus the new one), the quantized part read as ``dequantize(quantize(x))`` with the gradient of ``x``
    (``dequantize(quantize(x @ Q)) @ Qᵀ`` for a rotated kind)."""
    settings = settings.for_model_dtype(key.dtype)  # the metadata dtype a cache of this model uses
    sinks, kv_heads = settings.sink_tokens, key.shape[1]
    rep = query.shape[1] // kv_heads
    outputs = []
    for t in range(query.shape[2]):
        keys, values = key[:, :, : t + 1], value[:, :, : t + 1]
        qk, qv = settings.quantized_key_count(t), settings.quantized_value_count(t)
        if qk:
            block = keys[:, :, sinks : sinks + qk]
            g, bits = settings.key_group_size, settings.key_bits
            q = rotation_matrix(settings.key_rotation, key.shape[3])
            codes = ref.quantize_keys(rotate(block.detach(), q), g, bits, settings.meta_dtype, settings.fit)
            dequantized = unrotate(ref.dequantize_keys(*codes, qk, g, bits, torch.float32), q, key.dtype)
            block = dequantized + (block - block.detach())
            keys = torch.cat([keys[:, :, :sinks], block, keys[:, :, sinks + qk :]], dim=2)
        if qv:
            block = values[:, :, sinks : sinks + qv]
            g, bits = settings.value_group_size, settings.value_bits
            q = rotation_matrix(settings.value_rotation, value.shape[3])
            codes = ref.quantize_values(rotate(block.detach(), q), g, bits, settings.meta_dtype, settings.fit)
            dequantized = unrotate(ref.dequantize_values(*codes, qv, g, bits, torch.float32), q, value.dtype)
            block = dequantized + (block - block.detach())
            values = torch.cat([values[:, :, :sinks], block, values[:, :, sinks + qv :]], dim=2)
        scores = query[:, :, t : t + 1] @ repeat_kv(keys, rep).transpose(2, 3) * scaling
        outputs.append(torch.softmax(scores, dim=-1) @ repeat_kv(values, rep))
    return torch.cat(outputs, dim=2)


@pytest.mark.parametrize(
    "settings",
    [
        KiviSettings(group_size=8, residual_length=16),
        KiviSettings(group_size=8, residual_length=16, preset="paper"),
        KiviSettings(group_size=8, residual_length=16, sink_tokens=3, key_bits=4, value_group_size=16),
        KiviSettings(group_size=8, residual_length=16, preset="paper", value_rotation="hadamard"),
    ],
    ids=("default", "paper", "sinks-K4-Gv16-rotated", "paper-rotated-values"),
)
def test_qat_attention_and_its_straight_through_gradient_equal_the_literal_decode(settings):
    b, hq, kv_heads, n, d = 2, 6, 2, 75, 32
    leaves = [torch.randn(b, h, n, d, requires_grad=True) for h in (hq, kv_heads, kv_heads)]
    upstream = torch.randn(b, hq, n, d)
    out, _ = qat_attention(*leaves, settings, scaling=d**-0.5)
    got = torch.autograd.grad((out * upstream).sum(), leaves)
    expected_out = decode_step_by_step(*leaves, settings, d**-0.5)
    expected = torch.autograd.grad((expected_out * upstream).sum(), leaves)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    for g, e, name in zip(got, expected, ("query", "key", "value"), strict=True):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=name)
    # Straight-through: the noise enters the forward only, so the gradient w.r.t. the values is the same linear
    # map of the probabilities as without quantization (d out / d value = probs^T, whatever the noise).
    exact_out, exact_probs = qat_attention(*leaves, None, scaling=d**-0.5)
    _, probs = qat_attention(*leaves, settings, scaling=d**-0.5)
    grouped = probs.reshape(b, kv_heads, hq // kv_heads, n, n).transpose(-1, -2)
    value_grad = (grouped @ upstream.reshape(b, kv_heads, hq // kv_heads, n, d)).sum(2)
    torch.testing.assert_close(got[2], value_grad, rtol=1e-4, atol=1e-5)
    assert (out - exact_out).abs().max() > 1e-2


def test_model_gradient_equals_the_literal_decode_gradient():
    settings = KiviSettings(group_size=8, residual_length=16, sink_tokens=2)
    options = dict(group_size=8, residual_length=16, sink_tokens=2)

    def literal(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return decode_step_by_step(query, key, value, settings, scaling).transpose(1, 2), None

    AttentionInterface.register("kivi_qat_literal_test", literal)
    input_ids = torch.randint(0, VOCAB, (2, 50))

    def gradients(model):
        model.zero_grad()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    model = llama()
    model.train()
    with kivi_qat(model, **options):
        qat_loss, qat_grads = gradients(model)
    model.set_attn_implementation("kivi_qat_literal_test")
    literal_loss, literal_grads = gradients(model)
    model.set_attn_implementation("sdpa")
    exact_loss, exact_grads = gradients(model)
    torch.testing.assert_close(qat_loss, literal_loss)
    for name, grad in qat_grads.items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, literal_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert abs(qat_loss - exact_loss) > 1e-6  # the quantization shows (least-squares fits: ~1e-5 on this tiny model)
    assert any((qat_grads[k] - exact_grads[k]).abs().max() > 1e-5 for k in qat_grads)


@pytest.mark.parametrize("rotation", ROTATIONS)
def test_fake_quantized_states_match_the_quantizer_and_keep_sinks_exact(rotation):
    settings = KiviSettings(group_size=8, residual_length=16, sink_tokens=3, rotation=rotation)
    key, value = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    fake_k, fake_v = fake_quantized_states(key, value, settings)
    assert torch.equal(fake_k[:, :, :3], key[:, :, :3]) and torch.equal(fake_v[:, :, :3], value[:, :, :3])
    # Keys: whole groups of 8 after the sinks ([3, 27)); the trailing partial group [27, 30) is never read quantized.
    q = rotation_matrix(rotation, 16)
    codes = ref.quantize_keys(rotate(key[:, :, 3:27], q).contiguous(), 8, 2, torch.float16, settings.fit)
    assert torch.equal(fake_k[:, :, 3:27], unrotate(ref.dequantize_keys(*codes, 24, 8, 2), q))
    assert torch.equal(fake_k[:, :, 27:], key[:, :, 27:])
    codes = ref.quantize_values(rotate(value[:, :, 3:], q).contiguous(), 8, 2, torch.float16, settings.fit)
    assert torch.equal(fake_v[:, :, 3:], unrotate(ref.dequantize_values(*codes, 27, 8, 2), q))


def test_softcap_and_padding_rows():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out, _ = qat_attention(q, k, v, None, scaling=1.0, softcap=2.0)
    scores = 2.0 * torch.tanh(q @ k.transpose(2, 3) / 2.0)
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    mask[..., 0] = False  # query 0 attends to nothing (a padding query)
    out, probs = qat_attention(q, k, v, KiviSettings(group_size=8, residual_length=8), mask)
    assert torch.equal(out[:, :, 0], torch.zeros(1, 2, 8)) and torch.isfinite(out).all()


def test_dropout_applies_only_in_training():
    q, k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    settings = KiviSettings(group_size=8, residual_length=8)
    plain, _ = qat_attention(q, k, v, settings)
    evaluating, _ = qat_attention(q, k, v, settings, dropout=0.5, training=False)
    torch.manual_seed(1)
    dropped, probs = qat_attention(q, k, v, settings, dropout=0.5, training=True)
    assert torch.equal(evaluating, plain) and (dropped - plain).abs().max() > 1e-2
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    assert 0.35 < (probs[..., causal] == 0).float().mean() < 0.65  # about half of the attended weights dropped


def test_attn_implementation_is_restored_even_after_an_error():
    model = llama()
    assert model.config._attn_implementation == "sdpa"
    with kivi_qat(model, group_size=8, residual_length=16):
        assert model.config._attn_implementation == QAT_ATTENTION_NAME
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_kivi_qat_settings") for m in model.modules())
    with pytest.raises(ZeroDivisionError), kivi_qat(model, group_size=8):
        raise ZeroDivisionError
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with kivi_qat(model, group_size=8):
        pass
    assert model.config._attn_implementation == "eager"


def test_read_masks_handed_out_are_copies():
    settings = KiviSettings(group_size=4, residual_length=8)
    keys, values = decode_read_masks(settings, 20)
    expected = keys.clone(), values.clone()
    keys.zero_(), values.zero_()  # a caller's edit must not change the noise kivi_qat trains with
    again = decode_read_masks(settings, 20)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1]) and bool(again[0].any())
    with pytest.raises(ValueError, match="`length` must be a non-negative integer"):
        decode_read_masks(settings, -1)
    with pytest.raises(TypeError, match="`settings` must be a KiviSettings"):
        decode_read_masks({"group_size": 4}, 20)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 4, 8, 16), (1, 2, 8, 16), (1, 1, 8, 16)), "`key` and `value` must share batch, kv heads and tokens"),
        (((1, 4, 8, 16), (1, 2, 8, 8), (1, 2, 8, 8)), "head_dim of `query`"),
        (
            ((4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)),
            r"`query` must have rank 4 \[batch, heads, tokens, head_dim\], got shape \(4, 8, 16\)",
        ),
    ],
)
def test_qat_attention_refuses_mismatched_states(shapes, match):
    query, key, value = (torch.randn(shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        qat_attention(query, key, value, KiviSettings(group_size=4, residual_length=8))


def test_bad_input_raises_clear_errors():
    model = llama()
    with pytest.raises(TypeError, match="unknown kivi_qat option.*residual_lenght"):
        kivi_qat(model, residual_lenght=16)
    with pytest.raises(TypeError, match="backend"):
        kivi_qat(model, backend="sycl")
    with pytest.raises(ValueError, match="sink_tokens"):
        kivi_qat(model, residual_length=16, group_size=8, sink_tokens=16)
    with pytest.raises(ValueError, match="head_dim"):
        kivi_qat(model, group_size=32, residual_length=64)  # head_dim is 16
    with pytest.raises(ValueError, match="prefill_length"):
        kivi_qat(model, group_size=8, prefill_length=-1)
    with pytest.raises(ValueError, match="layer_overrides"):
        kivi_qat(model, group_size=8, layer_overrides=[None])  # 2 layers
    cache = KiviCache(config=model.config, backend="reference", group_size=8)
    with pytest.raises(ValueError, match="either `cache` or"):
        kivi_qat(model, cache, bits=4)
    with pytest.raises(ValueError, match="config=model.config"):
        kivi_qat(model, KiviCache(backend="reference"))
    with pytest.raises(TypeError, match="KiviCache"):
        kivi_qat(model, DynamicCache())
    with pytest.raises(ValueError, match="3 layers"):
        kivi_qat(model, KiviCache(config=llama(num_hidden_layers=3).config, backend="reference", group_size=8))
    with pytest.raises(ValueError, match="head_dim"):  # a cache built for a model with head_dim 32
        kivi_qat(model, KiviCache(config=llama(head_dim=32).config, backend="reference", group_size=32))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        kivi_qat(torch.nn.Linear(2, 2))

    input_ids = torch.randint(0, VOCAB, (1, 12))
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids[:, :4], **cache_argument(past), use_cache=True)
        with kivi_qat(model, group_size=8), pytest.raises(ValueError, match="past_key_values"):
            model(input_ids[:, 4:], **cache_argument(past), use_cache=True)
        qat = kivi_qat(model, group_size=8)
        with qat, pytest.raises(RuntimeError, match="already active"), kivi_qat(model, cache):
            pass
        model.set_attn_implementation(QAT_ATTENTION_NAME)
        with pytest.raises(RuntimeError, match="kivi_qat"):
            model(input_ids)
