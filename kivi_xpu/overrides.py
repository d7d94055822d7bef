"""Per-layer settings from a file: :func:`load_layer_overrides` reads the ``layer_overrides`` JSON that
``kivi-xpu calibrate`` writes (or one written by hand), for ``KiviCache(config, layer_overrides="file.json")``;
:func:`auto_layer_overrides` finds the calibration shipped for a model (``layer_overrides="auto"``, the default) and
logs, once per model, when none applies."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shlex
from collections.abc import Mapping
from pathlib import Path

import torch

from .ops.checks import META_DTYPES

# JSON holds no torch dtypes: a `meta_dtype` entry is written as its name ("float16" or "torch.float16").
META_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in META_DTYPES}

logger = logging.getLogger("kivi_xpu")


def load_layer_overrides(path: str | os.PathLike, config=None) -> list[dict | None]:
    """The ``layer_overrides`` list of the JSON file ``path``: one entry per decoder layer, each ``null`` (the
    cache's settings) or an object of :class:`~kivi_xpu.KiviSettings` fields to change for that layer, such as
    ``{"key_bits": 4}``; ``meta_dtype`` names become torch dtypes. The file is an object with a
    ``"layer_overrides"`` key (what ``kivi-xpu calibrate`` writes; its other keys are ignored) or that list itself.

    The entries change the settings of the cache they are given to: a file calibrated with other base settings
    (its ``"base"`` object) means something else there. With ``config`` (a model config), the number of entries
    is checked against its decoder layers. Raises ``ValueError`` naming ``layer_overrides`` and the file when it
    is missing, is not such JSON, or has the wrong number of entries; the fields themselves are checked by
    ``KiviCache`` (:meth:`~kivi_xpu.KiviCache.layer_settings`).
    """
    where = f"`layer_overrides` file {str(path)!r}"
    return _entries(_read_json(path, where), where, config)


def _read_json(path: str | os.PathLike, where: str):
    """The JSON of ``path``; ``ValueError`` starting with ``where`` when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{where} cannot be read: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where} is not valid JSON: {error}") from None


def _entries(data, where: str, config) -> list[dict | None]:
    """:func:`load_layer_overrides` of the parsed JSON ``data`` (``where`` names its file in errors)."""
    entries = data.get("layer_overrides") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(
            f'{where} must hold a JSON object with a list under "layer_overrides" (as `kivi-xpu calibrate` writes) '
            f"or that list itself, one entry (null or an object) per decoder layer; got {_kind(data, entries)}"
        )
    overrides = [override_entry(entry, f"{where}: entry {index}") for index, entry in enumerate(entries)]
    if config is not None:
        layers = getattr(config.get_text_config(decoder=True), "num_hidden_layers", None)
        if layers is not None and len(overrides) != layers:
            raise ValueError(
                f"{where} has {len(overrides)} entries but the model has {layers} decoder layers: it was made for "
                "another model (or edited); give exactly one entry (null or an object) per layer"
            )
    return overrides


def _kind(data, entries) -> str:
    if isinstance(data, dict):
        found = "nothing" if entries is None else f"a {type(entries).__name__}"
        return f'an object with {found} under "layer_overrides"'
    return f"a JSON {type(data).__name__}"


def override_entry(entry, where: str) -> dict | None:
    """One JSON entry of a ``layer_overrides`` list as ``KiviCache`` takes it: ``None``, or a dict copy with a
    ``meta_dtype`` name turned into the torch dtype; ``ValueError`` starting with ``where`` for anything else."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be null or an object of KiviSettings fields, got {json.dumps(entry)}")
    return meta_dtype_named(dict(entry), f"{where}: `meta_dtype`")


def meta_dtype_named(options: dict, what: str) -> dict:
    """``options`` (changed in place) with a ``meta_dtype`` given by name (JSON files and GenerationConfig hold names)
    replaced by the torch dtype; ``ValueError`` "<what> must be one of [...]" for an unknown name."""
    meta = options.get("meta_dtype")
    if isinstance(meta, str):
        name = meta.removeprefix("torch.")
        if name not in META_DTYPE_NAMES:
            raise ValueError(f"{what} must be one of {list(META_DTYPE_NAMES)}, got {meta!r}")
        options["meta_dtype"] = META_DTYPE_NAMES[name]
    return options


def settings_json(settings) -> dict:
    """A :class:`~kivi_xpu.KiviSettings` (or a dict of its fields) as a JSON object: dtypes by name."""
    if not isinstance(settings, dict):
        settings = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.init and f.name != "_"}
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in settings.items()}


# ------------------------------------------------------------------------------------------- shipped calibrations

AUTO = "auto"  # KiviCache's default layer_overrides: the calibration shipped for the model, if any
CALIBRATIONS = Path(__file__).parent / "calibrations"  # calibrations shipped with kivi_xpu, one JSON per model
CHECKPOINT_CALIBRATION = "kivi_calibration.json"  # a calibration shipped in a checkpoint's own directory
_FINGERPRINT_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                       "num_key_value_heads", "vocab_size")  # fmt: skip
_UNCOMPARED = ("meta_dtype", "preset")  # the metadata dtype follows the model's dtype; a preset only fills fields


def model_fingerprint(config) -> dict:
    """What a calibration checks of a model config before it applies: its checkpoint's name (the last part of
    ``_name_or_path``) and the decoder's shape (``kivi-xpu calibrate`` writes it as ``"fingerprint"``)."""
    text = config.get_text_config(decoder=True)
    shape = {name: getattr(text, name, None) for name in _FINGERPRINT_FIELDS}
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    shape["head_dim"] = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    name = Path(str(getattr(config, "_name_or_path", "") or "")).name
    return {"name": name, "config": shape}


def shipped_calibration(config) -> Path | None:
    """The calibration shipped for the model of ``config``: ``kivi_calibration.json`` in its checkpoint directory,
    else a file of :data:`CALIBRATIONS` whose ``"fingerprint"`` has the model's name (case aside) and shape; ``None``
    when there is none."""
    found = _calibration_for(config, model_fingerprint(config))
    return None if found is None else found[0]


@functools.cache
def _shipped() -> tuple[tuple[Path, dict], ...]:
    """Every file of :data:`CALIBRATIONS` with its JSON, read once per process (the package's files do not change,
    and a ``KiviCache`` is built for every ``generate``)."""
    return tuple((path, _read_json(path, f"shipped calibration {str(path)!r}"))
                 for path in sorted(CALIBRATIONS.glob("*.json")))  # fmt: skip


def _calibration_for(config, fingerprint: dict) -> tuple[Path, dict] | None:
    """:func:`shipped_calibration`'s path and its JSON, for ``config`` of ``fingerprint``."""
    local = Path(str(getattr(config, "_name_or_path", "") or "")) / CHECKPOINT_CALIBRATION
    if getattr(config, "_name_or_path", "") and local.is_file():
        return local, _read_json(local, f"calibration {str(local)!r}")
    name = fingerprint["name"].lower()
    for path, data in _shipped():
        shipped = data.get("fingerprint", {})
        if name and shipped.get("name", "").lower() == name and shipped.get("config") == fingerprint["config"]:
            return path, data
    return None


def auto_layer_overrides(config, settings) -> tuple[list[dict | None] | None, Path | None]:
    """``layer_overrides="auto"``: the per-layer entries of :func:`shipped_calibration` and its path, when its
    ``"base"`` is ``settings`` (a :class:`~kivi_xpu.KiviSettings`; the metadata dtype aside, which follows the
    model's dtype); otherwise ``(None, None)``: every layer takes ``settings``. A checkpoint's own calibration made
    for another shape is an error (``ValueError`` naming the file)."""
    if not hasattr(config, "get_text_config"):
        return None, None  # no config (or not one: KiviCache names that)
    fingerprint = model_fingerprint(config)
    found = _calibration_for(config, fingerprint)
    if found is None:
        _log_uncalibrated(config, fingerprint, settings, None)
        return None, None
    path, data = found
    shipped = data.get("fingerprint", {}).get("config")
    if shipped is not None and shipped != fingerprint["config"]:
        raise ValueError(
            f"calibration {str(path)!r} was made for a model of shape {shipped}, not this one "
            f"({fingerprint['config']}): remove it or pass layer_overrides=None"
        )
    base = {k: v for k, v in data.get("base", {}).items() if k not in _UNCOMPARED}
    ours = {k: v for k, v in settings_json(settings).items() if k not in _UNCOMPARED}
    if base != ours:
        _log_uncalibrated(config, fingerprint, settings, path)
        return None, None
    return _entries(data, f"`layer_overrides` file {str(path)!r}", config), path


_LOGGED: set[str] = set()  # the models (fingerprints) whose missing calibration was logged in this process


def _log_uncalibrated(config, fingerprint: dict, settings, other_base: Path | None) -> None:
    """Logs (WARNING, logger ``kivi_xpu``) once per model and process that ``"auto"`` found no calibration for it
    (``other_base``: the one found was made on other base settings), what every layer takes instead, and the
    ``kivi-xpu calibrate`` command that makes one. ``KiviCache`` and the vLLM plugin both come through here."""
    key = json.dumps(fingerprint, sort_keys=True, default=str)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    model = getattr(config, "_name_or_path", "") or ""
    shape = fingerprint["config"]
    layers = f"{shape['num_hidden_layers']} layers"
    named = f"{model} ({shape['model_type']}, {layers})" if model else (
        f"this {shape['model_type']} model ({layers}, hidden size {shape['hidden_size']})"
    )  # fmt: skip
    what = (
        f"the calibration shipped for {named} ({str(other_base)!r}) was made on other base settings"
        if other_base is not None
        else f"no calibration is shipped for {named}"
    )
    logger.warning(
        "kivi_xpu: %s, so every layer takes the same settings (%s). A calibration chooses per-layer settings for "
        'the same memory: `%s`, then layer_overrides="calibration.json" (KiviCache, or vLLM\'s "kivi" config). '
        "layer_overrides=None keeps every layer alike without this message.",
        what,
        describe_settings(settings),
        calibrate_command(model or "CHECKPOINT", settings),
    )


def describe_settings(settings) -> str:
    """A :class:`~kivi_xpu.KiviSettings` in a few words, e.g. ``"2-bit, G=32, R=128, 4 sinks, hadamard,
    least_squares"`` (keys and values named apart where they differ)."""

    def pair(key, value, form: str) -> str:
        return form.format(key) if key == value else f"keys {form.format(key)}, values {form.format(value)}"

    def rotation(name: str) -> str:
        return "no rotation" if name == "none" else name

    return ", ".join(
        (
            pair(settings.key_bits, settings.value_bits, "{}-bit"),
            pair(settings.key_group_size, settings.value_group_size, "G={}"),
            f"R={settings.residual_length}",
            f"{settings.sink_tokens} sinks",
            pair(rotation(settings.key_rotation), rotation(settings.value_rotation), "{}"),
            settings.fit,
        )
    )


_TOOL_DEFAULTS = {"bits": 2, "group_size": 32, "residual_length": 128}  # kivi-xpu calibrate's --bits, ...


def calibrate_command(model: str, settings) -> str:
    """The ``kivi-xpu calibrate`` command line whose base is ``settings`` (so that ``"auto"`` would apply its
    output on them), for the checkpoint ``model``; the metadata dtype aside (it follows the model's dtype)."""
    args = ["kivi-xpu calibrate", "--model", shlex.quote(model)]
    for name, value in _TOOL_DEFAULTS.items():
        if getattr(settings, name) != value:
            args += ["--" + name.replace("_", "-"), str(getattr(settings, name))]
    # The fields the tool has no flag for, as --kivi-option: the preset's first, then the per-kind ones that no
    # longer follow them.
    shared = {"sink_tokens", "rotation", "fit"}
    derived = type(settings)(settings.bits, settings.group_size, settings.residual_length)
    options = {f: getattr(settings, f) for f in sorted(shared) if getattr(settings, f) != getattr(derived, f)}
    derived = derived.replace(**options)
    per_kind = ("key_bits", "value_bits", "key_group_size", "value_group_size", "key_rotation", "value_rotation")
    options |= {f: getattr(settings, f) for f in per_kind if getattr(settings, f) != getattr(derived, f)}
    for name, value in options.items():
        args += ["--kivi-option", f"{name}={value}"]
    return " ".join([*args, "--output", "calibration.json"])


def settings_for_layer(settings, overrides, layer_idx: int, head_dim: int | None = None):
    """``settings`` (a :class:`~kivi_xpu.KiviSettings`) with layer ``layer_idx``'s entry of ``overrides`` applied
    (``None``, a sequence of ``None`` or dicts, or a callable ``layer_idx -> dict | None``), checked against
    ``head_dim`` when given: ``KiviCache.layer_settings`` and the vLLM plugin resolve layers alike. Raises a
    ``ValueError`` naming the layer and the field for a bad override."""
    if overrides is None:
        return settings
    if callable(overrides):
        where = f"`layer_overrides({layer_idx})`"
        changes = overrides(layer_idx)
    else:
        where = f"`layer_overrides[{layer_idx}]`"
        if not 0 <= layer_idx < len(overrides):
            raise IndexError(f"layer {layer_idx} has no entry in `layer_overrides` ({len(overrides)} entries)")
        changes = overrides[layer_idx]
    if changes is None:
        return settings
    if not isinstance(changes, Mapping):
        raise TypeError(f"{where} must be None or a dict of KiviSettings fields, got {type(changes).__name__}")
    try:
        layer = settings.replace(**changes)
        if head_dim is not None:
            layer.check_head_dim(head_dim)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} = {dict(changes)!r} is invalid for layer {layer_idx}: {error}") from None
    return layer
