"""Shipped calibrations (``layer_overrides="auto"``, KiviCache's default): found for the model they were made for,
applied only on the settings they were calibrated on, and never for another model; where none applies, one log
line per model says what applies instead and how to calibrate."""

import argparse
import json
import logging

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


# ---------------------------------------------------------------------------------------------------------------
# the log line when no calibration applies


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kivi_xpu" and "every layer takes" in r.getMessage()]


def test_an_uncalibrated_model_is_logged_once_with_what_applies_and_the_command(tmp_path, caplog):
    """Once per model, not per cache or layer; it names the settings every layer takes and how to calibrate."""
    config = tiny_llama_config()
    config._name_or_path = str(tmp_path)  # a model of its own: no earlier test logged it
    with caplog.at_level(logging.WARNING, logger="kivi_xpu"):
        for _ in range(3):
            assert KiviCache(config).calibration is None
        KiviCache(config, group_size=16)  # other settings, the same model
    said = _said(caplog)
    assert len(said) == 1, said
    assert caplog.records[0].levelno == logging.WARNING
    assert f"no calibration is shipped for {tmp_path} (llama, 2 layers)" in said[0]
    assert "every layer takes the same settings (2-bit, G=32, R=128, 4 sinks, hadamard, least_squares)" in said[0]
    assert f"`kivi-xpu calibrate --model {tmp_path} --output calibration.json`" in said[0]
    assert 'layer_overrides="calibration.json"' in said[0]


def test_the_command_logged_calibrates_on_the_cache_settings(tmp_path, caplog):
    """Its flags give the calibration the cache's settings as its base, so that "auto" applies its output."""
    from kivi_xpu.tools.calibrate import CalibrateOptions, add_arguments
    from kivi_xpu.tools.specs import kivi_kwargs

    config = tiny_llama_config()
    config._name_or_path = str(tmp_path)
    given = dict(bits=4, group_size=16, residual_length=64, preset="paper", key_bits=8, value_rotation="hadamard")
    with caplog.at_level(logging.WARNING, logger="kivi_xpu"):
        cache = KiviCache(config, **given)
    (said,) = _said(caplog)
    assert "(keys 8-bit, values 4-bit, G=16, R=64, 0 sinks, keys no rotation, values hadamard, minmax)" in said
    command = said.split("`")[1].split()
    assert command[:3] == ["kivi-xpu", "calibrate", "--model"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = CalibrateOptions.from_namespace(parser.parse_args(command[2:]))
    assert KiviCache(config, **kivi_kwargs(options, options.bits[0]), layer_overrides=None).settings == cache.settings


def test_a_calibration_made_on_other_settings_is_named_in_the_log(checkpoint, caplog):
    config, path = checkpoint
    with caplog.at_level(logging.WARNING, logger="kivi_xpu"):
        KiviCache(config, preset="paper")
    (said,) = _said(caplog)
    assert f"the calibration shipped for {config._name_or_path} (llama, 2 layers) ({str(path)!r}) was made on " in said
    assert "--kivi-option fit=minmax --kivi-option rotation=none --kivi-option sink_tokens=0" in said


def test_no_log_when_a_calibration_applies_or_for_layer_overrides_none(checkpoint, tmp_path, caplog):
    config, _ = checkpoint
    shipped = next(iter(_shipped().values()))["fingerprint"]  # SmolLM2-135M-Instruct's shape and name
    shape = dict(shipped["config"])
    smollm2 = LlamaConfig(**{k: v for k, v in shape.items() if k not in ("model_type", "head_dim")})
    smollm2._name_or_path = "HuggingFaceTB/" + shipped["name"]
    uncalibrated = tiny_llama_config(num_hidden_layers=5)
    uncalibrated._name_or_path = str(tmp_path / "other")
    with caplog.at_level(logging.DEBUG, logger="kivi_xpu"):
        assert KiviCache(config).calibration is not None
        assert KiviCache(smollm2).calibration is not None
        KiviCache(uncalibrated, layer_overrides=None)
        KiviCache(uncalibrated, layer_overrides=[None] * 5)
        KiviCache()  # no config: no model to name
    assert _said(caplog) == []


def test_the_vllm_plugin_logs_through_the_same_place(tmp_path, caplog):
    from kivi_xpu.vllm.plan import resolve_layer_settings

    config = tiny_llama_config()
    config._name_or_path = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kivi_xpu"):
        settings, calibration = resolve_layer_settings({}, config, 2, 32, torch.float32)
        resolve_layer_settings({}, config, 2, 32, torch.float32)
        KiviCache(config)
    assert calibration is None and len(settings) == 2
    assert len(_said(caplog)) == 1
