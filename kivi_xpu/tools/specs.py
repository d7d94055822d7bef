"""Which cache configurations a tool runs (``--caches`` x ``--bits``) and how each is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import DynamicCache, StaticCache

from ..cache import KiviCache
from .cli import first_line
from .options import CACHE_NAMES, DTYPES, ToolError, ToolOptions

FULL_PRECISION = ("dynamic", "static")
HF_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
HF_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq.core.quantize", "hqq")}


@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration: a name from ``CACHE_NAMES``, a bit width (``None`` for the full-precision
    ``dynamic`` and ``static``) and, for KIVI,
    the extra ``--kivi-option`` settings as text (shown in the label)."""

    name: str
    bits: int | None = None
    options: str = ""

    @property
    def label(self) -> str:
        label = self.name if self.bits is None else f"{self.name} {self.bits}-bit"
        return f"{label} ({self.options})" if self.options else label

    def row_fields(self) -> dict:
        """The fields that name this configuration in a result row: ``cache`` (the label), ``name``, ``bits``."""
        return {"cache": self.label, "name": self.name, "bits": self.bits}

    @property
    def attn_implementation(self) -> str:
        return "kivi" if self.name == "kivi-fused" else "sdpa"


def cache_specs(options: ToolOptions) -> list[CacheSpec]:
    """The configurations to run (caches x bits), the full-precision ``dynamic`` and ``static`` first (the
    references of the ratios)."""
    names = list(dict.fromkeys(options.caches))
    kivi_options = ", ".join(f"{k}={_short(v)}" for k, v in options.kivi_options)
    specs = [CacheSpec(name) for name in FULL_PRECISION if name in names]
    for name in names:
        if name not in FULL_PRECISION:
            extra = kivi_options if name.startswith("kivi") else ""
            specs += [CacheSpec(name, b, extra) for b in dict.fromkeys(options.bits)]
    return specs


def _short(value) -> str:
    return str(value).removeprefix("torch.")


def unavailable_reason(spec: CacheSpec) -> str | None:
    """Why a transformers ``QuantizedCache`` configuration cannot run here (``None`` if it can)."""
    if spec.name not in HF_BITS:
        return None
    module, package = HF_PACKAGES[spec.name]
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001  (a broken third-party install is reported, not raised)
        return f"not installed: {package} ({type(err).__name__}: {err})"
    if spec.bits not in HF_BITS[spec.name]:
        return f"unsupported: {spec.name} takes {', '.join(map(str, HF_BITS[spec.name]))} bits"
    return None


def kivi_kwargs(options: ToolOptions, bits: int) -> dict:
    """Keyword arguments of ``KiviCache`` from the options (the extra ``kivi_options`` passed unchanged)."""
    kwargs = {
        "bits": bits,
        "group_size": options.group_size,
        "residual_length": options.residual_length,
        "meta_dtype": None if options.meta_dtype is None else DTYPES[options.meta_dtype],
        "backend": options.backend,
        "device": options.sycl_device,  # KiviCache's device is the SYCL filter; the model's is options.device
    }
    kwargs.update(dict(options.kivi_options))
    return kwargs


def make_cache(spec: CacheSpec, config, options: ToolOptions, max_cache_len: int | None = None):
    """A fresh cache for ``spec``; ``max_cache_len`` (tokens) sizes a ``StaticCache`` and is ignored by the others."""
    if spec.name == "dynamic":
        return DynamicCache(config=config)
    if spec.name == "static":
        if max_cache_len is None:
            raise ValueError("a StaticCache needs `max_cache_len` (context + new tokens)")
        return StaticCache(config=config, max_cache_len=max_cache_len)
    if spec.name in ("kivi-fused", "kivi-dense"):
        attention = "auto" if spec.name == "kivi-fused" else "dense"
        return KiviCache(config=config, attention=attention, **kivi_kwargs(options, spec.bits))
    if spec.name in HF_BITS:
        from transformers import QuantizedCache

        # HQQ groups along axis 1 of the flattened states (the channels of one token); along axis 0 its groups would
        # mix batch rows. quanto's axis 0 already groups the channels of one token.
        axis = 1 if spec.name == "hqq" else 0
        return QuantizedCache(
            backend=spec.name,
            config=config,
            nbits=spec.bits,
            axis_key=axis,
            axis_value=axis,
            q_group_size=options.group_size,
            residual_length=options.residual_length,
        )
    raise ValueError(f"unknown cache {spec.name!r}; choose from {CACHE_NAMES}")


def check_cache_options(specs: list[CacheSpec], config, options: ToolOptions) -> None:
    """Builds each KIVI configuration once, so that bad KIVI options fail before any measurement."""
    for spec in specs:
        if spec.name.startswith("kivi"):
            try:
                make_cache(spec, config, options)
            except (ValueError, TypeError, RuntimeError) as err:
                raise ToolError(f"KiviCache({_format_kwargs(kivi_kwargs(options, spec.bits))}): {err}") from None


def _format_kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None)


def third_party_failure(spec: CacheSpec, function: Callable, *args):
    """``(function(*args), None)``, or ``(None, reason)`` when a transformers ``QuantizedCache`` backend
    (third-party code) raises: such a failure is reported, not allowed to end the whole run. Errors of the other
    caches propagate."""
    if spec.name not in HF_BITS:
        return function(*args), None
    try:
        return function(*args), None
    except Exception as err:  # noqa: BLE001
        return None, f"failed: {type(err).__name__}: {first_line(err)}"
