"""Fused attention on the packed history: the packed score/value ops against dense math, the softmax over
[history | tail] against SDPA on dequantized states, and generation through the fused path against the dense path."""

import warnings

import pytest
import tiny_models as models
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from kivi_xpu import KiviCache, codec, use_fused_attention
from kivi_xpu.integration import cache_argument
from kivi_xpu.ops import for_backend
from kivi_xpu.ops import reference as ref


def kernels_for(backend_name):
    """The checked ops of a backend, as attributes."""
    return for_backend(backend_name)


def no_history(b, kv_heads, d, group=16, bits=2):
    """Empty packed keys and values ([B, Hkv, *, 0...] buffers, count 0): attention over exact states only."""
    empty = torch.empty(b, kv_heads, 0, d)
    return ref.quantize_keys(empty, group, bits), ref.quantize_values(empty, group, bits)


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("gqa", (1, 3, 8))
@pytest.mark.parametrize("tokens, head_dim, group, q_len", [(32, 64, 32, 1), (160, 128, 32, 3), (1056, 80, 16, 1)])
def test_packed_key_scores_equal_dense_scores(backend_name, bits, gqa, tokens, head_dim, group, q_len):
    kernels = kernels_for(backend_name)
    b, kv_heads = 2, 2
    keys = torch.randn(b, kv_heads, tokens + 2 * group, head_dim)  # over-allocated: only `tokens` are read
    codes, scales, zeros = ref.quantize_keys(keys, group, bits)
    query = torch.randn(b, kv_heads * gqa, q_len, head_dim)
    got = kernels.packed_key_scores(query, codes, scales, zeros, tokens, group, bits)
    dense = ref.dequantize_keys(codes, scales, zeros, tokens, group, bits).repeat_interleave(gqa, dim=1)
    expected = query @ dense.transpose(2, 3)
    assert got.shape == (b, kv_heads * gqa, q_len, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("gqa", (1, 3, 8))
@pytest.mark.parametrize("tokens, head_dim, group, q_len", [(1, 64, 32, 1), (33, 128, 32, 2), (1025, 80, 16, 1)])
def test_packed_value_combine_equals_dense_sum(backend_name, bits, gqa, tokens, head_dim, group, q_len):
    kernels = kernels_for(backend_name)
    b, kv_heads = 2, 2
    values = torch.randn(b, kv_heads, tokens + 7, head_dim)
    codes, scales, zeros = ref.quantize_values(values, group, bits)
    probs = torch.softmax(torch.randn(b, kv_heads * gqa, q_len, tokens), dim=-1)
    got = kernels.packed_value_combine(probs, codes, scales, zeros, tokens, group, bits)
    dense = ref.dequantize_values(codes, scales, zeros, tokens, group, bits).repeat_interleave(gqa, dim=1)
    assert got.shape == (b, kv_heads * gqa, q_len, head_dim)
    torch.testing.assert_close(got, probs @ dense, rtol=1e-5, atol=1e-5)


def test_packed_attention_ops_reject_bad_input(backend_name):
    kernels = kernels_for(backend_name)
    codes, scales, zeros = ref.quantize_keys(torch.randn(1, 2, 64, 64), 32, 2)
    with pytest.raises(ValueError, match="query"):
        kernels.packed_key_scores(torch.randn(1, 3, 1, 64), codes, scales, zeros, 64, 32, 2)  # 3 heads, 2 kv heads
    with pytest.raises(ValueError, match="head_dim"):
        kernels.packed_key_scores(torch.randn(1, 2, 1, 32), codes, scales, zeros, 64, 32, 2)
    with pytest.raises(TypeError, match="query"):
        kernels.packed_key_scores(torch.randn(1, 2, 1, 64).half(), codes, scales, zeros, 64, 32, 2)
    codes, scales, zeros = ref.quantize_values(torch.randn(1, 2, 10, 64), 32, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        kernels.packed_value_combine(torch.rand(1, 2, 1, 12), codes, scales, zeros, 12, 32, 2)
    with pytest.raises(ValueError, match="`codes` must hold at least one kv head"):
        kernels.packed_value_combine(torch.rand(1, 2, 1, 8), codes[:, :0], scales[:, :0], zeros[:, :0], 8, 32, 2)


@pytest.mark.parametrize("q_len", (1, 5))
@pytest.mark.parametrize("padded", (False, True))
def test_softmax_over_history_and_tail_equals_sdpa(backend_name, q_len, padded, exact_arithmetic):
    kernels = kernels_for(backend_name)
    b, hq, kv_heads, d, g, bits = 2, 6, 2, 64, 32, 2
    tk, tv, n = 96, 70, 100  # keys and values quantize different counts (blocks vs FIFO)
    keys, values = torch.randn(b, kv_heads, n, d), torch.randn(b, kv_heads, n, d)
    kc, ks, kz = ref.quantize_keys(keys[:, :, :tk], g, bits)
    vc, vs, vz = ref.quantize_values(values[:, :, :tv], g, bits)
    dense_k = torch.cat([ref.dequantize_keys(kc, ks, kz, tk, g, bits), keys[:, :, tk:]], dim=2)
    dense_v = torch.cat([ref.dequantize_values(vc, vs, vz, tv, g, bits), values[:, :, tv:]], dim=2)
    query = torch.randn(b, hq, q_len, d)
    mask = torch.ones(b, 1, q_len, n, dtype=torch.bool).tril(n - q_len)
    if padded:
        mask[1, ..., :9] = False  # the second sequence is left-padded by 9 tokens
    out = kernels.decode_attention(
        query,
        *(keys[:, :, :0], kc, ks, kz, tk, g, bits, keys[:, :, tk:]),
        *(values[:, :, :0], vc, vs, vz, tv, g, bits, values[:, :, tv:]),
        mask if padded else None,
        d**-0.5,
        0.0,
    )
    rep = hq // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, dense_k.repeat_interleave(rep, 1), dense_v.repeat_interleave(rep, 1), attn_mask=mask
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_fully_masked_rows_give_zeros_and_nan_elsewhere_propagates(backend_name):
    b, hq, kv_heads, d, n = 2, 4, 2, 16, 9
    query, keys, values = torch.randn(b, hq, 2, d), torch.randn(b, kv_heads, n, d), torch.randn(b, kv_heads, n, d)
    mask = torch.ones(b, 1, 2, n, dtype=torch.bool).tril(n - 2)
    mask[1, :, 0] = False  # the first query of the second sequence is padding: it attends to nothing
    (kc, ks, kz), (vc, vs, vz) = no_history(b, kv_heads, d)

    def attend(keys, values):
        packed_keys, packed_values = (keys[:, :, :0], kc, ks, kz, 0, 16, 2), (values[:, :, :0], vc, vs, vz, 0, 16, 2)
        return kernels_for(backend_name).decode_attention(
            query, *packed_keys, keys, *packed_values, values, mask, d**-0.5, 0.0
        )

    out = attend(keys, values)
    assert torch.equal(out[1, :, 0], torch.zeros(hq, d))
    rep = hq // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), attn_mask=mask
    )
    torch.testing.assert_close(out[0], expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1, :, 1], expected[1, :, 1], rtol=1e-4, atol=1e-5)
    # A NaN key reaches every row that attends to it, as in a dense softmax: never hidden as zeros.
    keys[:, :, 3, 0] = float("nan")
    out = attend(keys, values)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1, :, 1]).all()
    assert torch.equal(out[1, :, 0], torch.zeros(hq, d))  # the padding row still attends to nothing


def test_decode_attention_op_reads_over_allocated_buffers_with_and_without_sinks(backend_name):
    b, hq, kv_heads, d, g, bits = 2, 6, 2, 32, 16, 2
    decode_attention = kernels_for(backend_name).decode_attention
    for sinks in (0, 3):
        tk, tv, n = 32, 41, 60
        keys, values = torch.randn(b, kv_heads, n, d), torch.randn(b, kv_heads, n, d)
        spare = torch.randn(b, kv_heads, 2 * g, d)  # codes beyond `count` must never be read
        kc, ks, kz = ref.quantize_keys(torch.cat([keys[:, :, sinks : sinks + tk], spare], dim=2), g, bits)
        vc, vs, vz = ref.quantize_values(torch.cat([values[:, :, sinks : sinks + tv], spare], dim=2), g, bits)
        dense_k, dense_v = keys.clone(), values.clone()
        dense_k[:, :, sinks : sinks + tk] = ref.dequantize_keys(kc, ks, kz, tk, g, bits)
        dense_v[:, :, sinks : sinks + tv] = ref.dequantize_values(vc, vs, vz, tv, g, bits)
        query = torch.randn(b, hq, 1, d)
        out = decode_attention(
            query,
            *(keys[:, :, :sinks], kc, ks, kz, tk, g, bits, keys[:, :, sinks + tk :]),
            *(values[:, :, :sinks], vc, vs, vz, tv, g, bits, values[:, :, sinks + tv :]),
            None,
            d**-0.5,
            0.0,
        )
        rep = hq // kv_heads
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, dense_k.repeat_interleave(rep, 1), dense_v.repeat_interleave(rep, 1)
        )
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def tiny_llama(kv_heads=2):  # 8 query heads, head_dim 16
    return models.tiny_llama(num_attention_heads=8, num_key_value_heads=kv_heads, pad_token_id=0)


def generate(model, attn, backend_name, ids, mask=None, **kwargs):
    model.set_attn_implementation(attn)
    cache = KiviCache(config=model.config, bits=2, group_size=16, residual_length=32, backend=backend_name)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, do_sample=False, **kwargs)
    return out, cache


@pytest.mark.parametrize("kv_heads", (1, 2, 8))  # MQA, GQA, MHA
def test_fused_greedy_generation_matches_the_dense_path_for_200_tokens(backend_name, kv_heads):
    model = tiny_llama(kv_heads)
    ids = torch.randint(1, 256, (1, 45))
    dense, _ = generate(model, "sdpa", backend_name, ids, max_new_tokens=200, min_new_tokens=200)
    fused, cache = generate(model, "kivi", backend_name, ids, max_new_tokens=200, min_new_tokens=200)
    assert torch.equal(dense, fused)
    assert cache.layers[0].keys_stream.packed.num_tokens == 224  # the history really was packed


def test_fused_batched_left_padded_generation_matches_the_dense_path(backend_name):
    model = tiny_llama()
    ids = torch.randint(1, 256, (2, 40))
    mask = torch.ones_like(ids)
    ids[0, :11], mask[0, :11] = 0, 0  # left padding
    dense, _ = generate(model, "sdpa", backend_name, ids, mask, max_new_tokens=80, min_new_tokens=80)
    fused, _ = generate(model, "kivi", backend_name, ids, mask, max_new_tokens=80, min_new_tokens=80)
    assert torch.equal(dense, fused)


def test_fused_multi_token_append_matches_the_dense_path(backend_name):
    model = tiny_llama()
    tokens = torch.randint(1, 256, (1, 150))
    logits = {}
    for attn in ("sdpa", "kivi"):
        model.set_attn_implementation(attn)
        cache = KiviCache(config=model.config, group_size=16, residual_length=32, backend=backend_name)
        with torch.no_grad():
            model(tokens[:, :70], **cache_argument(cache))
            model(tokens[:, 70:71], **cache_argument(cache))
            logits[attn] = model(tokens[:, 71:150], **cache_argument(cache)).logits  # 79 tokens onto a history
    torch.testing.assert_close(logits["kivi"], logits["sdpa"], rtol=1e-4, atol=1e-4)


def test_kivi_attention_with_other_caches_is_plain_sdpa():
    model = tiny_llama()
    ids = torch.randint(1, 256, (1, 30))
    outs = []
    for attn in ("sdpa", "kivi"):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            outs.append(
                model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=20, min_new_tokens=20)
            )
    assert torch.equal(outs[0], outs[1])


def test_use_fused_attention_switches_the_model():
    model = tiny_llama()
    use_fused_attention(model)
    assert model.config._attn_implementation == "kivi"


def test_sliding_window_layers_stay_dense_under_kivi_attention():
    config = MistralConfig(**models.TINY_LLAMA, sliding_window=48)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(1, 256, (1, 30))
    outs = []
    for attn in ("sdpa", "kivi"):
        model.set_attn_implementation(attn)
        with pytest.warns(UserWarning, match="no layer of this MistralConfig uses full attention"):
            cache = KiviCache(config=model.config, group_size=16, residual_length=32, backend="reference")
        with torch.no_grad():
            outs.append(model.generate(ids, cache=cache, max_new_tokens=60, min_new_tokens=60, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def decode_logits(model, attn, backend_name, ids, prefill=40, **cache_kwargs):
    """Logits of teacher-forced decode steps after a ``prefill``-token prefill (G=16, R=32: 32 keys and 8 values of
    the prefill are packed), through the fused (``attn="kivi"``) or dense (``"sdpa"``) path."""
    model.set_attn_implementation(attn)
    cache = KiviCache(config=model.config, group_size=16, residual_length=32, backend=backend_name, **cache_kwargs)
    with torch.no_grad():
        model(ids[:, :prefill], **cache_argument(cache))
        steps = [model(ids[:, t : t + 1], **cache_argument(cache)).logits for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1).float()


def overflow_warnings(record) -> int:
    return sum("overflow the float16 scales" in str(w.message) for w in record)


def test_keys_overflowing_fp16_metadata_give_nan_logits_in_both_paths_and_one_warning(backend_name, monkeypatch):
    monkeypatch.setattr(codec, "_overflow_warned", False)  # (the warning moved to the codec)
    model = tiny_llama().to(torch.bfloat16)
    with torch.no_grad():  # layer 0's keys ~1e5: fine in bf16, beyond float16's 65504
        model.model.layers[0].self_attn.k_proj.weight.mul_(4e5)
    ids = torch.randint(1, 256, (1, 44))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fused = decode_logits(model, "kivi", backend_name, ids, meta_dtype=torch.float16)
        dense = decode_logits(model, "sdpa", backend_name, ids, meta_dtype=torch.float16)
    assert fused.isnan().all() and dense.isnan().all()  # never plausible garbage from one path only
    assert overflow_warnings(record) == 1  # once per process, naming the cause and the fix
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for attn in ("kivi", "sdpa"):  # bfloat16 metadata, the default for a bfloat16 model, holds them
            assert decode_logits(model, attn, backend_name, ids).isfinite().all()
    assert overflow_warnings(record) == 0


@pytest.mark.parametrize("position", (5, 35), ids=("packed", "window"))
def test_one_inf_key_gives_the_same_nan_logits_in_both_paths(backend_name, position):
    model = tiny_llama()

    def one_inf_key(module, args, out):
        if out.shape[1] > position:  # the prefill: key `position`, first channel
            out = out.clone()
            out[:, position, 0] = float("inf")
        return out

    model.model.layers[0].self_attn.k_proj.register_forward_hook(one_inf_key)
    ids = torch.randint(1, 256, (1, 44))
    fused = decode_logits(model, "kivi", backend_name, ids)
    dense = decode_logits(model, "sdpa", backend_name, ids)
    assert torch.equal(fused.isnan(), dense.isnan())
    if position < 32:  # a packed key: its whole group dequantizes to NaN, which every query meets
        assert fused.isnan().all()
    else:  # an exact key: +-inf scores, NaN as in SDPA (none of it hidden as zeros)
        assert fused.isnan().any()


def test_output_attentions_returns_the_weights_of_eager_attention(backend_name):
    """Prefill and decode steps under "kivi" with output_attentions=True give one weight tensor per layer, equal to
    eager attention on the same (dequantized) keys and values, and the same outputs: while nothing is quantized they
    equal eager attention with a DynamicCache, and once the history is packed the weights still sum to 1 per row."""
    model = models.tiny_llama()
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    runs = {}
    for attention, cache in (
        ("kivi", KiviCache(config=model.config, residual_length=32, group_size=16, backend=backend_name)),
        ("eager", DynamicCache(config=model.config)),
    ):
        model.set_attn_implementation(attention)
        with torch.inference_mode():
            steps = [model(ids[:, :20], **cache_argument(cache), output_attentions=True)]
            steps += [model(ids[:, t : t + 1], **cache_argument(cache), output_attentions=True) for t in range(20, 70)]
        runs[attention] = steps
    for t, (kivi, eager) in enumerate(zip(runs["kivi"], runs["eager"], strict=True)):
        assert len(kivi.attentions) == model.config.num_hidden_layers
        for mine, theirs in zip(kivi.attentions, eager.attentions, strict=True):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine.sum(-1), torch.ones_like(mine.sum(-1)))
            if t < 13:  # 20 + 12 tokens held: nothing quantized yet (R = 32)
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert runs["kivi"][-1].attentions[0].shape[-1] == 70
