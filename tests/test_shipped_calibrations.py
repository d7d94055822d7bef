"""Shipped calibrations (``layer_overrides="auto"``, KiviCache's default): found for the model they were made for,
applied only on the settings they were calibrated on, and never for another model."""

import json

import pytest
import torch
from tiny_models import tiny_llama_config
from transformers import LlamaConfig

from kivi_xpu import KiviCache
from kivi_xpu.overrides import CALIBRATIONS, CHECKPOINT_CALIBRATION, model_fingerprint, settings_json

PER_LAYER = [{"value_group_size": 16}, {"key_bits": 4}]


def _write_calibration(directory, config, base=None, overrides=PER_LAYER):
    """A calibration as ``kivi-xpu calibrate`` writes it, saved as the checkpoint's own ``kivi_calibration.json``."""
    base = settings_json(KiviCache().settings.for_model_dtype(torch.float32)) if base is None else base
    payload = {"fingerprint": model_fingerprint(config), "base": base, "layer_overrides": overrides}
    path = directory / CHECKPOINT_CALIBRATION
    path.write_text(json.dumps(payload))
    return path


@pytest.fixture
def checkpoint(tmp_path):
    config = tiny_llama_config()
    config._name_or_path = str(tmp_path)
    return config, _write_calibration(tmp_path, config)


def test_a_checkpoints_own_calibration_applies_to_the_default_settings(checkpoint):
    config, path = checkpoint
    cache = KiviCache(config)
    assert cache.calibration == path
    assert cache.layer_settings(0).value_group_size == 16 and cache.layer_settings(0).key_bits == 2
    assert cache.layer_settings(1).key_bits == 4 and cache.layer_settings(1).value_group_size == 32


@pytest.mark.parametrize("meta_dtype", [torch.bfloat16, torch.float32])
def test_the_metadata_dtype_does_not_stop_a_calibration(checkpoint, meta_dtype):
    """Its base names the metadata dtype of the model it was made on; a bf16 model stores bf16 scales."""
    config, path = checkpoint
    assert KiviCache(config, meta_dtype=meta_dtype).calibration == path


@pytest.mark.parametrize(
    "settings", [dict(bits=4), dict(preset="paper"), dict(fit="minmax"), dict(residual_length=64), dict(group_size=16)]
)
def test_other_settings_than_its_base_take_no_calibration(checkpoint, settings):
    """Per-layer entries are changes to the base: on other settings they would mean something else."""
    config, _ = checkpoint
    cache = KiviCache(config, **settings)
    assert cache.calibration is None
    assert cache.layer_settings(1) == cache.settings


def test_none_and_explicit_overrides_replace_the_calibration(checkpoint):
    config, _ = checkpoint
    assert KiviCache(config, layer_overrides=None).calibration is None
    assert KiviCache(config, layer_overrides=None).layer_settings(1).key_bits == 2
    explicit = KiviCache(config, layer_overrides=[None, {"value_bits": 4}])
    assert explicit.calibration is None and explicit.layer_settings(1).value_bits == 4


def test_a_checkpoints_calibration_for_another_shape_is_named(tmp_path):
    config = tiny_llama_config()
    config._name_or_path = str(tmp_path)
    _write_calibration(tmp_path, tiny_llama_config(num_hidden_layers=3), overrides=[None] * 3)
    with pytest.raises(ValueError, match=f"calibration .*{CHECKPOINT_CALIBRATION}.* was made for a model of shape"):
        KiviCache(config)


def test_no_calibration_without_a_config_or_for_an_unnamed_model():
    assert KiviCache().calibration is None
    assert KiviCache(tiny_llama_config()).calibration is None


def _shipped():
    return {path.name: json.loads(path.read_text()) for path in sorted(CALIBRATIONS.glob("*.json"))}


def test_every_shipped_calibration_names_its_model_and_is_found_for_it_alone():
    shipped = _shipped()
    assert shipped, f"no calibration in {CALIBRATIONS}"
    for name, payload in shipped.items():
        fingerprint = payload["fingerprint"]
        shape = dict(fingerprint["config"])
        head_dim = shape.pop("head_dim")
        config = LlamaConfig(**{k: v for k, v in shape.items() if k != "model_type"}, head_dim=head_dim)
        config._name_or_path = "HuggingFaceTB/" + fingerprint["name"]
        cache = KiviCache(config)
        assert cache.calibration == CALIBRATIONS / name
        assert len(payload["layer_overrides"]) == shape["num_hidden_layers"]
        assert payload["bits_per_element"] <= payload["base_bits_per_element"]  # the memory of the default
        config._name_or_path = "someone/" + fingerprint["name"] + "-finetune"
        assert KiviCache(config).calibration is None
        config._name_or_path = "HuggingFaceTB/" + fingerprint["name"]
        config.num_hidden_layers += 1
        assert KiviCache(config).calibration is None


def test_the_shipped_smollm2_calibration_is_found_for_the_real_checkpoint():
    from kivi_xpu.assets import cache_root

    checkpoint = cache_root() / "SmolLM2-135M-Instruct"
    if not (checkpoint / "config.json").is_file():
        pytest.skip("SmolLM2-135M-Instruct is not unpacked on this machine (kivi-xpu fetches it with pip)")
    from transformers import AutoConfig

    cache = KiviCache(AutoConfig.from_pretrained(checkpoint))
    assert cache.calibration is not None and cache.calibration.parent == CALIBRATIONS
