"""Options beyond the paper (attention sinks, rotations, separate key/value bits and group sizes, per-layer
overrides) and the exact rollback under past recording (transformers' assisted decoding): the streaming rule after
every step, fused vs dense vs reference agreement, crop and batch operations, memory, bad input. Reference and SYCL
backends."""

import random

import pytest
import tiny_models as models
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kivi_xpu import KiviCache, KiviLayer, KiviSettings
from kivi_xpu.algorithm import UNBOUNDED
from kivi_xpu.backend import select
from kivi_xpu.integration import cache_argument
from kivi_xpu.ops import for_backend
from kivi_xpu.ops import reference as ref
from kivi_xpu.rotation import ROTATIONS, rotate, rotation_matrix, unrotate

B, H, D = 2, 3, 64


def make_layer(backend_name, **kwargs):
    """A layer of the paper's algorithm with the options in ``kwargs`` (G=16, R=32 unless given)."""
    kwargs.setdefault("group_size", 16)
    kwargs.setdefault("residual_length", 32)
    kwargs.setdefault("preset", "paper")
    return KiviLayer(KiviSettings(**kwargs), select(backend_name))


def random_settings(rng: random.Random) -> dict:
    """Random valid settings with head_dim 64: per-kind bits, groups and rotations, R a multiple of the key group,
    S < R."""
    key_bits, value_bits = rng.choice((2, 4, 8)), rng.choice((2, 4, 8))
    key_group = rng.choice([g for g in (4, 8, 16, 32) if g % (8 // key_bits) == 0])
    value_group = rng.choice([g for g in (4, 8, 16, 32, 64) if g % (8 // value_bits) == 0])
    residual = key_group * rng.choice((1, 2, 3))
    return dict(
        key_bits=key_bits,
        value_bits=value_bits,
        key_group_size=key_group,
        value_group_size=value_group,
        residual_length=residual,
        sink_tokens=rng.randrange(0, min(residual, 6)),
        key_rotation=rng.choice(ROTATIONS),
        value_rotation=rng.choice(ROTATIONS),
    )


def split(n: int, sinks: int, residual: int) -> tuple[int, int]:
    """(quantized keys, quantized values) of ``n`` tokens, written out independently of KiviSettings."""
    after = max(0, n - sinks)
    return after - after % residual, max(0, after - residual)


def expected_dense(keys, values, held, s: KiviSettings):
    """What attention reads when ``held`` tokens were stored and ``keys/values [B, H, n, D]`` hold every token so
    far: exact sinks, the quantized spans round-tripped through the reference quantizer (in the rotated basis of a
    rotated kind: ``dequantize(quantize(x @ Q)) @ Qᵀ``), the rest exact."""
    s = s.for_model_dtype(keys.dtype)
    qk, qv = split(held, s.sink_tokens, s.residual_length)
    sink = min(held, s.sink_tokens)
    k, v = keys.clone(), values.clone()
    if qk:
        q = rotation_matrix(s.key_rotation, keys.shape[3])
        c, sc, z = ref.quantize_keys(
            rotate(keys[:, :, sink : sink + qk], q), s.key_group_size, s.key_bits, s.meta_dtype
        )
        dequantized = ref.dequantize_keys(c, sc, z, qk, s.key_group_size, s.key_bits, torch.float32)
        k[:, :, sink : sink + qk] = unrotate(dequantized, q, keys.dtype)
    if qv:
        q = rotation_matrix(s.value_rotation, values.shape[3])
        x = rotate(values[:, :, sink : sink + qv], q)
        c, sc, z = ref.quantize_values(x, s.value_group_size, s.value_bits, s.meta_dtype)
        dequantized = ref.dequantize_values(c, sc, z, qv, s.value_group_size, s.value_bits, torch.float32)
        v[:, :, sink : sink + qv] = unrotate(dequantized, q, values.dtype)
    return k, v


def assert_same_dense(actual, expected, s: KiviSettings) -> None:
    """Bit for bit without rotation; with one, up to the float rounding of the rotations (a matmul's result may
    depend on how many rows it multiplies at once)."""
    for a, e, rotation in zip(actual, expected, (s.key_rotation, s.value_rotation), strict=True):
        if rotation == "none":
            assert torch.equal(a, e)
        else:
            torch.testing.assert_close(a, e, rtol=0, atol=1e-5)


def check_counts(layer: KiviLayer, n: int) -> None:
    s = layer.settings
    qk, qv = split(n, s.sink_tokens, s.residual_length)
    sink = min(n, s.sink_tokens)
    assert layer.get_seq_length() == n
    assert s.quantized_key_count(n) == qk and s.quantized_value_count(n) == qv
    assert len(layer.keys_stream.sinks) == len(layer.values_stream.sinks) == sink
    assert layer.keys_stream.packed.num_tokens == qk and len(layer.keys_stream.window) == n - sink - qk
    assert layer.values_stream.packed.num_tokens == qv and len(layer.values_stream.window) == n - sink - qv
    assert len(layer.keys_stream.window) < s.residual_length and len(layer.values_stream.window) <= s.residual_length


def state(layer: KiviLayer) -> dict:
    """Everything a layer stores, as comparable tensors and counts."""
    out = {"length": layer.get_seq_length()}
    for kind, stream in zip(("keys", "values"), (layer.keys_stream, layer.values_stream), strict=True):
        out[f"{kind}.sinks"] = stream.sinks.view()
        out[f"{kind}.residual"] = stream.window.view()
        out[f"{kind}.count"] = stream.packed.num_tokens
        for name, buf in zip(("codes", "scales", "zeros"), stream.packed.buffers(), strict=True):
            out[f"{kind}.{name}"] = buf.view()
    return out


def assert_same_state(a: KiviLayer, b: KiviLayer) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name, value in sa.items():
        if isinstance(value, torch.Tensor):
            assert value.shape == sb[name].shape and torch.equal(value, sb[name]), name
        else:
            assert value == sb[name], name


# ---------------------------------------------------------------------------------------------------------------
# Settings


def test_the_paper_preset_is_the_paper():
    s = KiviSettings(preset="paper")
    assert (s.bits, s.group_size, s.residual_length, s.sink_tokens) == (2, 32, 128, 0)
    assert (s.key_rotation, s.value_rotation, s.fit) == ("none", "none", "minmax")
    assert (s.key_bits, s.value_bits, s.key_group_size, s.value_group_size) == (2, 2, 32, 32)
    assert [s.quantized_key_count(n) for n in (0, 127, 128, 300)] == [0, 0, 128, 256]
    assert [s.quantized_value_count(n) for n in (0, 128, 129, 300)] == [0, 0, 1, 172]
    assert s.bits_per_element() == 3.0  # 2 + 2 * 16 / 32


def test_the_fit_follows_the_preset_unless_given():
    assert KiviSettings().fit == "least_squares" and KiviSettings(preset="paper").fit == "minmax"
    assert KiviSettings(fit="minmax").replace(preset="paper").fit == "minmax"
    assert KiviSettings().replace(preset="paper").fit == "minmax"
    assert KiviCache(fit="minmax").settings.fit == "minmax"


def test_per_kind_fields_follow_the_shared_ones_unless_given():
    s = KiviSettings(bits=4, group_size=16, key_bits=2, value_group_size=64)
    assert (s.key_bits, s.value_bits, s.key_group_size, s.value_group_size) == (2, 4, 16, 64)
    # `replace` keeps derived fields derived and explicit ones explicit.
    t = s.replace(bits=8, group_size=32)
    assert (t.key_bits, t.value_bits, t.key_group_size, t.value_group_size) == (2, 8, 32, 64)
    assert s.replace(key_bits=4).key_bits == 4
    assert KiviSettings(key_bits=2, value_bits=2) == KiviSettings()


def test_bits_per_element_by_hand():
    k4v2 = KiviSettings(key_bits=4, value_bits=2)
    assert k4v2.key_bits_per_element() == 5.0 and k4v2.value_bits_per_element() == 3.0
    assert k4v2.bits_per_element() == 4.0
    mixed = KiviSettings(key_group_size=16, value_group_size=64, meta_dtype=torch.float32)
    assert mixed.bits_per_element() == ((2 + 64 / 16) + (2 + 64 / 64)) / 2


def test_sink_rule_counts():
    s = KiviSettings(group_size=16, residual_length=32, sink_tokens=4)
    # keys: blocks of 32 starting at position 4; values: all but the 4 sinks and the newest 32
    assert [s.quantized_key_count(n) for n in (0, 4, 35, 36, 67, 68, 100)] == [0, 0, 0, 32, 32, 64, 96]
    assert [s.quantized_value_count(n) for n in (0, 4, 36, 37, 100)] == [0, 0, 0, 1, 64]


@pytest.mark.parametrize("sinks, residual", [(0, 32), (4, 32), (3, 16), (1, 4), (7, 8)])
def test_token_split_covers_every_token_once(sinks, residual):
    """KiviSettings.split(n): per kind, sinks, packed tokens and window are consecutive, cover [0, n) and hold the
    rule's counts."""
    s = KiviSettings(group_size=residual if residual < 32 else 32, residual_length=residual, sink_tokens=sinks)
    for n in range(0, sinks + 4 * residual):
        split = s.split(n)
        assert (split.length, split.packed_keys, split.packed_values) == (
            n,
            s.quantized_key_count(n),
            s.quantized_value_count(n),
        )
        assert split.sinks == min(n, sinks) and split.sinks_full == (n >= sinks)
        for kind in ("keys", "values"):
            held, packed, window = split.ranges(kind)
            assert [*held, *packed, *window] == list(range(n)), (kind, n)
            assert len(packed) == split.packed(kind) and len(window) == split.window(kind)
            assert window.start == split.window_start(kind) or not window


@pytest.mark.parametrize("sinks, residual", [(0, 32), (4, 32), (3, 16), (1, 4), (7, 8)])
def test_steady_appends_follow_the_counts(sinks, residual):
    """steady_appends(kind, n): the one-token appends from n on during which the kind's count grows alike, found
    by stepping the counts themselves."""
    s = KiviSettings(group_size=residual if residual < 32 else 32, residual_length=residual, sink_tokens=sinks)
    counts = {"keys": s.quantized_key_count, "values": s.quantized_value_count}
    for kind, count in counts.items():
        for n in range(0, sinks + 4 * residual):
            growth = count(n + 1) - count(n)
            steps = 1
            while steps < 10 * residual and count(n + steps + 1) - count(n + steps) == growth:
                steps += 1
            got = s.steady_appends(kind, n)
            assert got == steps or (steps == 10 * residual and got == UNBOUNDED), (kind, n, got, steps)
    with pytest.raises(ValueError, match="`kind` must be 'keys' or 'values', got 'key'"):
        s.steady_appends("key", 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"sink_tokens": 32, "residual_length": 32, "group_size": 16},
            r"`sink_tokens` \(32\).*`residual_length` \(32\)",
        ),
        ({"sink_tokens": 40, "residual_length": 32, "group_size": 16}, "sink_tokens"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"key_bits": 3}, "key_bits"),
        ({"value_bits": 1}, "value_bits"),
        ({"key_group_size": 6}, "key_group_size"),  # not whole bytes at 2 bits
        ({"value_group_size": 2, "value_bits": 2}, "value_group_size"),
        ({"key_group_size": 48}, "multiple of `key_group_size`"),  # 48 does not divide R = 128
        ({"group_size": 0}, "group_size"),
        ({"fit": "mse"}, r"`fit` must be one of \('minmax', 'least_squares'\), got 'mse'"),
    ],
)
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KiviSettings(**kwargs)


@pytest.mark.parametrize(
    "residual, group, bits", [(1, 1, 8), (4, 2, 4), (4, 4, 2), (8, 4, 2), (16, 16, 2), (128, 32, 2)]
)
def test_the_default_sinks_never_reject_an_explicit_window(residual, group, bits):
    """Every window the paper preset accepts, the default accepts: its 4 sinks shrink to at most R - 1."""
    paper = KiviSettings(residual_length=residual, group_size=group, bits=bits, preset="paper")
    default = KiviSettings(residual_length=residual, group_size=group, bits=bits)
    assert paper.sink_tokens == 0 and default.sink_tokens == min(4, residual - 1)
    assert default.replace(residual_length=128, group_size=32).sink_tokens == 4  # the clamp follows R, not frozen
    with pytest.raises(ValueError, match=r"`sink_tokens` \(4\).*`residual_length` \(4\)"):
        KiviSettings(residual_length=4, group_size=4, sink_tokens=4)  # an explicit conflict is still an error


def test_a_small_window_with_the_default_preset_generates():
    model = models.tiny_llama()
    cache = KiviCache(config=model.config, residual_length=4, group_size=4)
    assert cache.layers[0].settings.sink_tokens == 3
    tokens = model.generate(
        torch.randint(3, 256, (1, 9)), cache=cache, max_new_tokens=12, do_sample=False, min_new_tokens=12
    )
    assert tokens.shape == (1, 21) and cache.get_seq_length() == 20


@pytest.mark.parametrize(
    "head_dim, kwargs, advice",
    [
        (48, {"key_group_size": 32, "value_group_size": 16}, "that work for 2-bit codes: 4, 8, 12, 16, 24, 48"),
        (1, {"group_size": 4}, r"cannot be quantized with 2 bits: use `key_bits=8` with `key_group_size` in \[1\]"),
        (6, {"group_size": 4}, r"use `key_bits=4` with `key_group_size` in \[2, 6\] or `key_bits=8`"),
    ],
)
def test_head_dim_errors_say_what_can_be_done(head_dim, kwargs, advice):
    with pytest.raises(ValueError, match=advice):
        KiviSettings(**kwargs).check_head_dim(head_dim)


def test_head_dim_errors_say_which_kind():
    with pytest.raises(ValueError, match="`key_group_size` \\(32\\) for the keys.*head_dim \\(48\\)"):
        KiviSettings(key_group_size=32, value_group_size=16).check_head_dim(48)
    with pytest.raises(ValueError, match="`value_group_size` \\(32\\) for the values.*head_dim \\(48\\)"):
        KiviSettings(key_group_size=16, value_group_size=32, residual_length=128).check_head_dim(48)
    with pytest.raises(ValueError, match="unknown KiviSettings field"):
        KiviSettings().replace(nbits=4)


def llama_config(layers=3, head_dim=64):
    return models.tiny_llama_config(num_hidden_layers=layers, hidden_size=head_dim * 4, pad_token_id=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sink_tokens": 128}, ValueError, r"`sink_tokens` \(128\).*`residual_length` \(128\)"),
        ({"key_group_size": 64, "head_dim": 96}, ValueError, "`key_group_size` .* for the keys"),
        ({"value_group_size": 64, "head_dim": 96}, ValueError, "`value_group_size` .* for the values"),
        ({"layer_overrides": [None, None]}, ValueError, "2 entries but the model has 3 decoder layers"),
        ({"layer_overrides": [None, {"kbits": 4}, None]}, ValueError, r"layer_overrides\[1\].*unknown.*kbits"),
        ({"layer_overrides": [None, None, {"key_bits": 3}]}, ValueError, r"layer_overrides\[2\].*`key_bits`"),
        ({"layer_overrides": lambda i: {"sink_tokens": 200} if i == 1 else None}, ValueError, r"\(1\).*sink_tokens"),
        ({"layer_overrides": [None, {"value_group_size": 128}, None]}, ValueError, r"\[1\].*value_group_size"),
        ({"layer_overrides": lambda i: 4}, TypeError, "None or a dict"),
        ({"layer_overrides": {"key_bits": 4}}, TypeError, "layer_overrides"),
        ({"layer_overrides": "key_bits=4"}, ValueError, "`layer_overrides` file .key_bits=4. cannot be read"),
    ],
)
def test_cache_rejects_bad_options(kwargs, error, match):
    kwargs = dict(kwargs)
    config = llama_config(head_dim=kwargs.pop("head_dim", 64))
    with pytest.raises(error, match=match):
        KiviCache(config=config, backend="reference", **kwargs)


def test_a_list_of_overrides_needs_a_config():
    with pytest.raises(ValueError, match="needs `config`.*callable"):
        KiviCache(layer_overrides=[None, {"key_bits": 4}], backend="reference")


# ---------------------------------------------------------------------------------------------------------------
# The layer honours the options


@pytest.mark.parametrize("seed", range(4))
def test_streaming_rule_with_options_after_every_step(backend_name, seed):
    rng = random.Random(seed)
    layer = make_layer(backend_name, **random_settings(rng))
    s = layer.settings
    total = 260
    keys, values = torch.randn(B, H, total, D), torch.randn(B, H, total, D)
    # A prefill that may end inside the sinks, then single-token decode steps with multi-token appends mixed in.
    sizes = [rng.randint(1, 40)]
    while sum(sizes) < total:
        sizes.append(min(total - sum(sizes), rng.choice((1, 1, 1, 1, 2, 5, 37))))
    n = 0
    for m in sizes:
        k_out, v_out = layer.update(keys[:, :, n : n + m], values[:, :, n : n + m])
        k_exp, v_exp = expected_dense(keys[:, :, : n + m], values[:, :, : n + m], n, s)
        assert_same_dense((k_out, v_out), (k_exp, v_exp), s)
        n += m
        check_counts(layer, n)
    assert torch.equal(layer.keys_stream.sinks.view(), keys[:, :, : s.sink_tokens])  # the sinks never changed


def test_packed_storage_uses_each_kinds_bits_and_group(backend_name):
    layer = make_layer(backend_name, key_bits=4, value_bits=2, key_group_size=8, value_group_size=32, sink_tokens=2)
    layer.update(torch.randn(B, H, 100, D), torch.randn(B, H, 100, D))
    key_codec, value_codec = layer.keys_stream.codec, layer.values_stream.codec  # (bits and groups: the codecs')
    assert (key_codec.bits, key_codec.group, value_codec.bits, value_codec.group) == (4, 8, 2, 32)
    keys, values = layer.keys_stream.packed, layer.values_stream.packed
    assert keys.codes.view().shape == (B, H, D, 96 // 2)  # 96 keys quantized, 2 codes per byte, channel-major
    assert keys.scales.view().shape == (B, H, D, 96 // 8)
    assert values.codes.view().shape == (B, H, 66, D // 4)  # 100 - 2 sinks - 32 window, 4 codes per byte
    assert values.scales.view().shape == (B, H, 66, D // 32)


@pytest.mark.parametrize("q_len", (1, 4))
@pytest.mark.parametrize("padded", (False, True))
def test_softmax_over_sinks_history_and_tail_equals_sdpa(backend_name, q_len, padded, exact_arithmetic):
    b, hq, kv_heads, d = 2, 6, 2, 64
    sinks, tk, tv, n = 4, 64, 50, 90  # positions: [sinks | quantized | exact tail], per side
    kb, kg, vb, vg = 4, 16, 2, 32
    keys, values = torch.randn(b, kv_heads, n, d), torch.randn(b, kv_heads, n, d)
    kc, ks, kz = ref.quantize_keys(keys[:, :, sinks : sinks + tk], kg, kb)
    vc, vs, vz = ref.quantize_values(values[:, :, sinks : sinks + tv], vg, vb)
    dense_k, dense_v = keys.clone(), values.clone()
    dense_k[:, :, sinks : sinks + tk] = ref.dequantize_keys(kc, ks, kz, tk, kg, kb)
    dense_v[:, :, sinks : sinks + tv] = ref.dequantize_values(vc, vs, vz, tv, vg, vb)
    query = torch.randn(b, hq, q_len, d)
    mask = torch.ones(b, 1, q_len, n, dtype=torch.bool).tril(n - q_len)
    if padded:
        mask[1, ..., :3] = False  # left padding reaching into the sinks
        mask[0, ..., 10] = False
    out = for_backend(backend_name).decode_attention(
        query,
        *(keys[:, :, :sinks], kc, ks, kz, tk, kg, kb, keys[:, :, sinks + tk :]),
        *(values[:, :, :sinks], vc, vs, vz, tv, vg, vb, values[:, :, sinks + tv :]),
        mask if padded else None,
        d**-0.5,
        0.0,
    )
    rep = hq // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, dense_k.repeat_interleave(rep, 1), dense_v.repeat_interleave(rep, 1), attn_mask=mask
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def tiny_llama(layers=3):
    return models.tiny_llama(num_hidden_layers=layers, pad_token_id=0)


OPTION_SETS = {
    "sinks": dict(sink_tokens=4),
    "k4v2": dict(key_bits=4, value_bits=2),
    "groups": dict(key_group_size=8, value_group_size=32, sink_tokens=1),
    "list": dict(layer_overrides=[None, {"key_bits": 8, "sink_tokens": 5}, {"value_group_size": 8, "bits": 4}]),
    "callable": dict(layer_overrides=lambda i: {"sink_tokens": i, "key_bits": 2 ** (i + 1)} if i else None),
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_fused_and_dense_paths_agree_with_options(backend_name, options, exact_arithmetic):
    model = tiny_llama()
    tokens = torch.randint(1, 256, (2, 150))
    logits = {}
    for attn in ("sdpa", "kivi"):
        model.set_attn_implementation(attn)
        cache = KiviCache(config=model.config, group_size=16, residual_length=32, backend=backend_name, **options)
        steps = []
        with torch.no_grad():
            steps.append(model(tokens[:, :3], **cache_argument(cache)).logits)  # a prefill shorter than the sinks
            for t in range(3, 70):
                steps.append(model(tokens[:, t : t + 1], **cache_argument(cache)).logits)
            steps.append(model(tokens[:, 70:150], **cache_argument(cache)).logits)  # 80 tokens onto a history
        logits[attn] = torch.cat(steps, dim=1)
        assert cache.layers[0].values_stream.packed.num_tokens > 0  # the history really was packed
    torch.testing.assert_close(logits["kivi"], logits["sdpa"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_fused_greedy_generation_equals_the_dense_path_with_options(options):
    model = tiny_llama()
    ids = torch.randint(1, 256, (1, 20))
    outs = []
    for attn in ("sdpa", "kivi"):
        model.set_attn_implementation(attn)
        cache = KiviCache(config=model.config, group_size=16, residual_length=32, backend="reference", **options)
        with torch.no_grad():
            outs.append(model.generate(ids, cache=cache, max_new_tokens=90, min_new_tokens=90))
    assert torch.equal(outs[0], outs[1])


def test_per_layer_settings_are_public_and_applied():
    config = llama_config()
    cache = KiviCache(
        config=config,
        group_size=16,
        residual_length=32,
        sink_tokens=2,
        layer_overrides=[None, {"key_bits": 4}, {"bits": 8, "value_group_size": 32}],
        backend="reference",
    )
    base = KiviSettings(group_size=16, residual_length=32, sink_tokens=2)
    assert cache.layers[0].settings == base == cache.layer_settings(0)
    assert cache.layers[1].settings == base.replace(key_bits=4) == cache.layer_settings(1)
    third = cache.layers[2].settings
    assert (third.key_bits, third.value_bits, third.key_group_size, third.value_group_size) == (8, 8, 16, 32)
    assert third.sink_tokens == 2
    for i, layer in enumerate(cache.layers):
        k = torch.randn(1, 2, 70, 64)
        cache.update(k, k, i)
        assert layer.keys_stream.codec.bits == cache.layer_settings(i).key_bits  # (bits are the codec's)


def test_callable_overrides_apply_to_lazily_created_layers():
    calls = []

    def overrides(i):
        calls.append(i)
        return {"sink_tokens": i} if i % 2 else None

    cache = KiviCache(group_size=16, residual_length=32, layer_overrides=overrides, backend="reference", preset="paper")
    assert cache.layer_settings(3).sink_tokens == 3
    for i in range(4):
        k = torch.randn(1, 2, 40, 32)
        cache.update(k, k, i)
    assert [layer.settings.sink_tokens for layer in cache.layers] == [0, 1, 0, 3]
    assert [len(layer.keys_stream.sinks) for layer in cache.layers] == [0, 1, 0, 3]

    bad = KiviCache(group_size=16, residual_length=32, layer_overrides=lambda i: {"key_bits": 5}, backend="reference")
    with pytest.raises(ValueError, match=r"layer_overrides\(0\).*key_bits"):
        bad.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32), 0)


def test_memory_report_with_options_by_hand(backend_name):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    cache = KiviCache(
        config=config,
        group_size=32,
        residual_length=128,
        key_bits=4,
        value_bits=2,
        key_group_size=16,
        value_group_size=64,
        sink_tokens=4,
        layer_overrides=[None, {"sink_tokens": 0}],
        backend=backend_name,
    )
    head_dim, n = 64, 1000
    for layer_idx in range(2):
        k = torch.randn(1, 2, n, head_dim)
        cache.update(k, k, layer_idx)
    report = cache.memory_report()
    kv_heads = 2
    # layer 0 (S=4): keys 896 of the 996 after the sinks, values 996 - 128 = 868; layer 1 (S=0): 896 and 872
    quantized_keys, quantized_values = 896 + 896, 868 + 872
    key_elements, value_elements = quantized_keys * kv_heads * head_dim, quantized_values * kv_heads * head_dim
    assert report.code_bytes == key_elements * 4 // 8 + value_elements * 2 // 8
    assert report.meta_bytes == key_elements // 16 * 2 * 2 + value_elements // 64 * 2 * 2  # fp16 scale + zero
    exact_tokens = (4 + (996 - 896) + 4 + 128) + ((1000 - 896) + 128)  # sinks + key block + value window
    assert report.residual_bytes == exact_tokens * kv_heads * head_dim * 4
    assert report.dense_bytes == 2 * 2 * n * kv_heads * head_dim * 4
    assert report.total_bytes <= report.allocated_bytes


# ---------------------------------------------------------------------------------------------------------------
# Crop and batch operations with sinks


@pytest.mark.parametrize("remove", [1, 10, 30, 60, 95, 97, 150])
def test_crop_with_sinks_restores_the_rule(backend_name, remove):
    layer = make_layer(backend_name, sink_tokens=3, key_bits=4, value_group_size=32)
    keys, values = torch.randn(B, H, 100, D), torch.randn(B, H, 100, D)
    layer.update(keys[:, :, :60], values[:, :, :60])
    for t in range(60, 100):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    seen_k, seen_v = layer.update(keys[:, :, :0], values[:, :, :0])
    layer.crop(-remove)
    n = max(0, 100 - remove)
    check_counts(layer, n)
    if n:
        k_now, v_now = layer.update(keys[:, :, :0], values[:, :, :0])
        torch.testing.assert_close(k_now, seen_k[:, :, :n], rtol=0, atol=1e-6)
        torch.testing.assert_close(v_now, seen_v[:, :, :n], rtol=0, atol=1e-6)
    # It keeps streaming by the rule, refilling the sinks if the crop reached into them.
    layer.update(keys[:, :, n:], values[:, :, n:])
    check_counts(layer, 100)
    assert torch.equal(layer.keys_stream.sinks.view(), keys[:, :, :3])


def test_batch_operations_with_sinks_match_a_cache_built_in_that_order(backend_name):
    settings = dict(sink_tokens=5, key_bits=4, value_bits=2, value_group_size=8)
    keys, values = torch.randn(3, H, 90, D), torch.randn(3, H, 90, D)
    perm = torch.tensor([2, 0, 0])
    a, b = make_layer(backend_name, **settings), make_layer(backend_name, **settings)
    a.update(keys[:, :, :80], values[:, :, :80])
    a.reorder_cache(perm)
    b.update(keys[perm, :, :80], values[perm, :, :80])
    assert_same_state(a, b)
    a.batch_select_indices(torch.tensor([1, 2]))
    b.batch_select_indices([1, 2])
    assert_same_state(a, b)
    a.batch_repeat_interleave(2)
    c = make_layer(backend_name, **settings)
    c.update(keys[perm][1:, :, :80].repeat_interleave(2, 0), values[perm][1:, :, :80].repeat_interleave(2, 0))
    assert_same_state(a, c)


def test_reset_forgets_the_sinks(backend_name):
    layer = make_layer(backend_name, sink_tokens=4)
    layer.update(torch.randn(B, H, 50, D), torch.randn(B, H, 50, D))
    layer.reset()
    k = torch.randn(1, H, 2, 32)
    assert layer.update(k, k)[0] is k
    check_counts(layer, 2)


# ---------------------------------------------------------------------------------------------------------------
# Exact crop under past recording (assisted decoding)


def test_recording_flags():
    layer = make_layer("reference")
    assert not layer.record_past and not layer.is_croppable
    layer.activate_past_recording()
    assert layer.record_past and layer.is_croppable
    layer.record_past = False  # what transformers' _DeferredStop.finish does
    assert not layer.is_croppable


@pytest.mark.parametrize("seed", range(6))
def test_crop_under_recording_is_bit_exact(backend_name, seed):
    rng = random.Random(seed)
    settings = random_settings(rng)
    r = settings["residual_length"]
    total = 12 * r + 200
    keys, values = torch.randn(B, H, total, D), torch.randn(B, H, total, D)
    recorded, plain = make_layer(backend_name, **settings), make_layer(backend_name, **settings)
    if seed % 2:
        recorded.activate_past_recording()  # also before the prefill
    x = rng.randint(1, 2 * r)
    recorded.update(keys[:, :, :x], values[:, :, :x])
    plain.update(keys[:, :, :x], values[:, :, :x])
    recorded.activate_past_recording()
    kept = x  # tokens both layers hold
    for _ in range(25):
        # m candidate tokens in one or a few forwards, then reject the last j of them (j = 0 commits all).
        m = rng.choice((1, 2, 5, r - 1, r, r + 1, 2 * r + 3))
        j = rng.choice((0, 1, m // 2, m - 1, m))
        if kept + m > total:
            break
        start = kept
        while start < kept + m:
            step = min(kept + m - start, rng.choice((1, m)))
            recorded.update(keys[:, :, start : start + step], values[:, :, start : start + step])
            start += step
        recorded.crop(-j)
        # every crop releases the copies
        assert len(recorded.keys_stream.departed) == len(recorded.values_stream.departed) == 0
        plain.update(keys[:, :, kept : kept + m - j], values[:, :, kept : kept + m - j])
        kept += m - j
        check_counts(recorded, kept)
        assert_same_state(recorded, plain)
    assert kept > x + 2 * r  # the walk crossed key blocks and value windows
    # Both keep streaming identically.
    recorded.update(keys[:, :, kept:], values[:, :, kept:])
    plain.update(keys[:, :, kept:], values[:, :, kept:])
    assert_same_state(recorded, plain)


def test_crop_that_removes_more_than_the_last_forward_is_lossy_but_follows_the_rule(backend_name):
    layer = make_layer(backend_name, sink_tokens=2)
    layer.activate_past_recording()
    keys, values = torch.randn(B, H, 120, D), torch.randn(B, H, 120, D)
    layer.update(keys[:, :, :100], values[:, :, :100])
    layer.crop(0)
    layer.update(keys[:, :, 100:110], values[:, :, 100:110])
    layer.crop(-40)  # 30 tokens more than the last forward added: those come back from their codes
    check_counts(layer, 70)
    exact = make_layer(backend_name, sink_tokens=2)
    exact.update(keys[:, :, :70], values[:, :, :70])
    k, v = layer.update(keys[:, :, :0], values[:, :, :0])
    k_exact, v_exact = exact.update(keys[:, :, :0], values[:, :, :0])
    assert not torch.equal(v, v_exact)  # values 36..69 had been quantized before the last crop
    # What it read at 100 tokens, cut to 70: the restored tokens keep the error of the codes they had then.
    expected_k, expected_v = expected_dense(keys[:, :, :100], values[:, :, :100], 100, layer.settings)
    torch.testing.assert_close(k, expected_k[:, :, :70], rtol=0, atol=1e-6)
    torch.testing.assert_close(v, expected_v[:, :, :70], rtol=0, atol=1e-6)


def test_nothing_is_recorded_unless_activated_and_copies_stay_bounded(backend_name):
    layer = make_layer(backend_name, residual_length=32)
    keys = torch.randn(1, H, 2000, D)
    layer.update(keys[:, :, :100], keys[:, :, :100])
    assert len(layer.keys_stream.departed) == len(layer.values_stream.departed) == 0
    layer.activate_past_recording()
    largest = 0
    for t in range(100, 2000, 5):  # verify 5 candidates, commit them
        layer.update(keys[:, :, t : t + 5], keys[:, :, t : t + 5])
        largest = max(largest, len(layer.keys_stream.departed), len(layer.values_stream.departed))
        layer.crop(0)
        assert len(layer.keys_stream.departed) == len(layer.values_stream.departed) == 0
    assert 0 < largest <= 32 + 5  # at most one key block or the new tokens, never the history
    layer.update(keys[:, :, :40], keys[:, :, :40])
    held = len(layer.keys_stream.departed) + len(layer.values_stream.departed)
    # 2000 -> 2040 tokens: one key block
    assert len(layer.values_stream.departed) == 40 and len(layer.keys_stream.departed) == 32
    recording = layer.memory_report().allocated_bytes
    layer.record_past = False  # transformers switches recording off when it hands the cache back
    assert len(layer.keys_stream.departed) == len(layer.values_stream.departed) == 0
    assert recording - layer.memory_report().allocated_bytes == held * H * D * 4  # the copies were reported


def test_cache_activates_recording_on_existing_and_lazily_created_layers(backend_name):
    cache = KiviCache(group_size=16, residual_length=32, sink_tokens=2, backend=backend_name)
    cache.activate_past_recording()
    for i in range(2):
        k = torch.randn(1, 2, 50, 32)
        cache.update(k, k, i)
    assert all(layer.record_past for layer in cache.layers) and cache.is_croppable
    cache.crop(-3)
    assert cache.get_seq_length() == 47
    for layer in cache.layers:
        layer.record_past = False
    assert not cache.is_croppable

    config = llama_config(layers=2)
    full = KiviCache(config=config, backend=backend_name)
    assert not full.is_croppable
    full.activate_past_recording()
    assert full.is_croppable


def test_assisted_generation_with_a_recording_kivi_cache():
    model = tiny_llama(layers=2)
    torch.manual_seed(1)
    assistant = LlamaForCausalLM(llama_config(layers=1, head_dim=32)).eval()
    ids = torch.randint(1, 256, (1, 30))
    cache = KiviCache(config=model.config, group_size=16, residual_length=32, sink_tokens=2, backend="reference")
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    with torch.no_grad():
        out = model.generate(
            ids, cache=cache, assistant_model=assistant, max_new_tokens=60, min_new_tokens=60, do_sample=False
        )
    assert out.shape[1] == 90
    assert any(n < 0 for n in crops)  # drafts were rejected: the rollback really ran
    # The cache holds exactly the sequence minus the last token, by the rule, as if built without rollbacks.
    for layer in cache.layers:
        check_counts(layer, out.shape[1] - 1)


def test_crop_takes_integer_like_counts_only():
    layer = make_layer("reference", sink_tokens=2)
    layer.update(torch.randn(1, H, 50, D), torch.randn(1, H, 50, D))
    layer.crop(torch.tensor(-3))  # a 0-d integer tensor, as a count computed on tensors would be
    assert layer.get_seq_length() == 47
    for bad in (-1.0, True, "-1"):
        with pytest.raises(TypeError, match="crop"):
            layer.crop(bad)
