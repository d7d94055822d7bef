"""The Hadamard rotation of the packed history (kivi_xpu.rotation) and the presets that turn it on: orthogonality,
where it applies (packed tokens only), that it lowers the quantization error it is meant to lower, and that every
path (dense, fused, QAT, crop) reads the same rotated history."""

from __future__ import annotations

import pickle

import pytest
import tiny_models as models
import torch

from kivi_xpu import KiviCache, KiviSettings
from kivi_xpu.codec import ValueCodec
from kivi_xpu.qat import fake_quantized_states
from kivi_xpu.rotation import ROTATIONS, hadamard_block, rotate, rotation_matrix, unrotate
from kivi_xpu.storage import PackedHistory


@pytest.mark.parametrize(("head_dim", "block"), [(1, 1), (2, 2), (40, 8), (48, 16), (64, 64), (80, 16), (96, 32)])
def test_hadamard_is_orthogonal_and_block_diagonal_over_the_largest_power_of_two(head_dim, block):
    q = rotation_matrix("hadamard", head_dim)
    assert q.dtype == torch.float32 and q.shape == (head_dim, head_dim)
    torch.testing.assert_close(q @ q.T, torch.eye(head_dim), rtol=0, atol=1e-6)
    assert hadamard_block(head_dim) == block
    # every entry of a block is +-1/sqrt(block); nothing outside the blocks
    inside = torch.block_diag(*([torch.ones(block, block)] * (head_dim // block))).bool()
    torch.testing.assert_close(q[inside].abs(), torch.full((int(inside.sum()),), block**-0.5))
    assert (q[~inside] == 0).all()


def test_rotation_names():
    assert ROTATIONS == ("none", "hadamard")
    assert rotation_matrix("none", 64) is None
    with pytest.raises(ValueError, match="`rotation` must be one of \\('none', 'hadamard'\\), got 'random'"):
        rotation_matrix("random", 64)
    x = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16)
    assert rotate(x, None) is x
    q = rotation_matrix("hadamard", 64)
    torch.testing.assert_close(unrotate(rotate(x, q), q, torch.float32), x.float(), rtol=0, atol=1e-5)


def test_presets_and_explicit_settings():
    default, paper = KiviSettings(), KiviSettings(preset="paper")
    assert (default.sink_tokens, default.key_rotation, default.value_rotation) == (4, "hadamard", "hadamard")
    assert (paper.sink_tokens, paper.key_rotation, paper.value_rotation) == (0, "none", "none")
    for s in (default, paper):  # the same stored bytes: 2-bit codes, G=32, R=128
        assert (s.bits, s.group_size, s.residual_length, s.bits_per_element()) == (2, 32, 128, 3.0)
    assert KiviSettings(preset="paper", sink_tokens=0, rotation="none") == paper
    assert default.replace(preset="paper") == paper  # preset-derived fields follow a new preset...
    mixed = KiviSettings(preset="paper", value_rotation="hadamard")
    assert (mixed.key_rotation, mixed.value_rotation, mixed.sink_tokens) == ("none", "hadamard", 0)
    assert mixed.replace(preset="default").value_rotation == "hadamard"  # ...given ones stay
    assert KiviSettings(rotation="none").replace(sink_tokens=2).key_rotation == "none"
    with pytest.raises(ValueError, match="`preset` must be one of \\('default', 'paper'\\)"):
        KiviSettings(preset="quarot")
    with pytest.raises(ValueError, match="`value_rotation` must be one of"):
        KiviSettings(value_rotation="walsh")
    with pytest.raises(TypeError, match="`rotation` must be a string"):
        KiviCache(rotation=True)


def test_cache_arguments_and_layer_overrides_reach_the_layers():
    config = models.tiny_llama_config()
    assert KiviCache(config).layers[0].settings == KiviSettings()
    assert KiviCache(config, preset="paper").layers[1].settings == KiviSettings(preset="paper")
    cache = KiviCache(config, preset="paper", layer_overrides=[{"rotation": "hadamard"}, {"preset": "default"}])
    first, second = (layer.settings for layer in cache.layers)
    assert (first.key_rotation, first.sink_tokens) == ("hadamard", 0)
    assert second == KiviSettings()
    assert "rotation=hadamard" in repr(cache.layers[1])
    with pytest.raises(ValueError, match="layer_overrides\\[0\\]"):
        KiviCache(config, layer_overrides=[{"key_rotation": "x"}, None])


def outlier_values(tokens=256, head_dim=64, seed=0) -> torch.Tensor:
    """Values with a few large channels, as attention values of real models have: [1, 2, tokens, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, tokens, head_dim, generator=gen)
    x[..., 5] *= 20
    x[..., 40] *= 8
    return x


def test_rotation_lowers_the_error_of_value_groups_with_outlier_channels():
    """A per-token value group holds an outlier channel beside small ones, so its 4 levels are spent on the outlier;
    the rotation spreads it over the group: the mean squared error of the stored values drops (min-max fits: the
    rotation on its own)."""
    x = outlier_values()
    errors = {}
    for rotation in ROTATIONS:
        settings = KiviSettings(rotation=rotation, residual_length=256, fit="minmax").for_model_dtype(torch.float32)
        codec = ValueCodec.of(settings, 64, "reference")  # (quantization is the codec's, storage only bytes)
        history = PackedHistory(codec.layout(settings.residual_length), 1, 2, "cpu")
        codec.pack(history, x)
        errors[rotation] = (codec.unpack(history, torch.float32) - x).pow(2).mean().item()
    assert errors["hadamard"] < 0.7 * errors["none"], errors


def test_only_the_packed_history_is_rotated_sinks_and_window_stay_exact(backend_name):
    torch.manual_seed(0)
    cache = KiviCache(group_size=8, residual_length=16, backend=backend_name)
    keys, values = torch.randn(1, 2, 53, 32), torch.randn(1, 2, 53, 32)
    dense_keys, dense_values = cache.update(keys, values, 0)
    layer = cache.layers[0]
    s, packed = 4, layer.keys_stream.packed.num_tokens
    assert packed == 48 and layer.values_stream.packed.num_tokens == 33
    for held, exact in ((layer.keys, keys), (layer.values, values)):
        assert torch.equal(held[:, :, :s], exact[:, :, :s])  # sinks
        assert not torch.equal(held[:, :, s : s + 33], exact[:, :, s : s + 33])  # packed
    assert torch.equal(layer.keys[:, :, s + packed :], keys[:, :, s + packed :])  # window
    assert torch.equal(layer.values[:, :, -16:], values[:, :, -16:])
    # the packed history read back equals QAT's fake quantization (same rotation, same quantizer)
    fake_keys, fake_values = fake_quantized_states(keys, values, layer.settings)
    torch.testing.assert_close(layer.keys[:, :, : s + packed], fake_keys[:, :, : s + packed], rtol=0, atol=1e-6)
    torch.testing.assert_close(layer.values[:, :, : s + 33], fake_values[:, :, : s + 33], rtol=0, atol=1e-6)


@pytest.mark.parametrize("rotation", ("keys", "values"))
def test_fused_equals_dense_with_one_kind_rotated_and_head_dim_48(backend_name, rotation):
    """head_dim 48: three 16-channel Hadamard blocks; one kind rotated, the other not."""
    model = models.tiny_llama(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    kinds = {"key_rotation": "hadamard" if rotation == "keys" else "none"}
    kinds["value_rotation"] = "hadamard" if rotation == "values" else "none"
    ids = torch.randint(1, 256, (2, 37))
    outputs = []
    for attn in ("sdpa", "kivi"):
        model.set_attn_implementation(attn)
        cache = KiviCache(model.config, group_size=16, residual_length=32, backend=backend_name, **kinds)
        with torch.no_grad():
            outputs.append(model.generate(ids, cache=cache, do_sample=False, max_new_tokens=70))
    assert torch.equal(outputs[0], outputs[1])


def test_a_rotated_cache_pickles_and_crops_back_to_its_codes():
    torch.manual_seed(1)
    cache = KiviCache(group_size=8, residual_length=16, backend="reference")
    cache.update(torch.randn(1, 2, 60, 32), torch.randn(1, 2, 60, 32), 0)
    before = cache.layers[0].keys[:, :, :30].clone()
    copy = pickle.loads(pickle.dumps(cache))
    assert torch.equal(copy.layers[0].keys, cache.layers[0].keys)
    cache.crop(-30)  # packed keys return to the window from their (rotated) codes, rotated back
    torch.testing.assert_close(cache.layers[0].keys, before, rtol=0, atol=1e-6)
