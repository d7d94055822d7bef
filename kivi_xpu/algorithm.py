"""The KIVI algorithm's settings and streaming policy, independent of storage, kernels and transformers.

KIVI (Liu et al., 2024) keeps the newest tokens of each layer in full precision and the older ones as
low-bit codes: keys per channel (a group is ``key_group_size`` consecutive tokens of one channel), values per
token (a group is ``value_group_size`` consecutive channels of one token). As the authors implement it
(jy-yuan/KIVI, ``models/llama_kivi.py``), for a layer holding ``n`` tokens after an update:

* keys: the first ``R * floor(n / R)`` tokens are quantized, the last ``n % R`` stay full precision
  (new keys gather in a full-precision buffer which is quantized as one block when it reaches ``R``);
* values: the first ``max(0, n - R)`` tokens are quantized, the last ``min(n, R)`` stay full precision
  (a FIFO of ``R`` tokens; the oldest leaves it quantized).

Beyond the paper, ``sink_tokens = S`` keeps the first ``S`` tokens of the sequence in full precision forever
("attention sinks"); the rules above then apply to the tokens after them: keys ``[S, S + R*floor((n-S)/R))``
and values ``[S, S + max(0, n - S - R))`` are quantized. With ``S = 0`` this is the paper's rule. ``rotation``
stores the packed history in a rotated basis (:mod:`kivi_xpu.rotation`), which changes what is quantized but not
which tokens are.

Presets (:data:`PRESETS`): ``"default"``, 4 sinks, Walsh-Hadamard rotated keys and values and least-squares group
fits, which cost no stored byte over the paper and a fraction of its perplexity loss (``docs/measurements.md``), and
``"paper"``, the authors' algorithm exactly (no sinks, no rotation, min-max groups). Both quantize 2-bit codes in
groups of 32 with a window of 128.

Prefill, single-token decode and multi-token appends (multi-turn chat, chunked prefill, assisted decoding)
all follow from these two counts. :meth:`KiviSettings.split` gives them, with the sinks and windows they leave, as
one :class:`TokenSplit`: what :class:`kivi_xpu.stream.KindStream` and the paged cache (:mod:`kivi_xpu.paged`) read
instead of working the positions out again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple

import torch

from .ops.checks import FITS, META_DTYPES, check_bits, check_group_size, check_meta_dtype, codes_per_byte
from .rotation import ROTATIONS
from .validation import integer, name_choice

# Fields whose default (None) means "the shared setting": key/value bits follow `bits`, groups follow `group_size`.
PER_KIND_FIELDS = {
    "key_bits": "bits",
    "value_bits": "bits",
    "key_group_size": "group_size",
    "value_group_size": "group_size",
    "key_rotation": "rotation",
    "value_rotation": "rotation",
}
# Fields whose default (None) means "the preset's value".
PRESETS = {
    "default": {"sink_tokens": 4, "rotation": "hadamard", "fit": "least_squares"},
    "paper": {"sink_tokens": 0, "rotation": "none", "fit": "minmax"},
}
PRESET_FIELDS = ("sink_tokens", "rotation", "fit")
_FOLLOWING_FIELDS = (*PER_KIND_FIELDS, *PRESET_FIELDS)  # fields that may follow another setting when not given
_NAMED_FIELDS = ("rotation", "key_rotation", "value_rotation", "fit")  # of those, the ones holding a name


# The longest full-precision window accepted: 16M tokens, above the longest context of any model today (~10M), so
# only a mistaken value (2**40) is refused, at construction rather than by the allocator at the first update.
MAX_RESIDUAL_LENGTH = 2**24
UNBOUNDED = 2**62  # KiviSettings.steady_appends of a count that grows alike forever


class TokenSplit(NamedTuple):
    """How a layer's ``length`` tokens split by the streaming rule (``S`` = ``sink_tokens``), positions in sequence
    order, for each kind (``"keys"``, ``"values"``):

    * the sinks ``[0, sinks)``, exact (``sinks = min(length, S)``);
    * the packed tokens ``[S, S + packed(kind))``, as codes;
    * the window ``[window_start(kind), length)``, exact (empty while ``length <= S``).

    Built by :meth:`KiviSettings.split` (a named tuple: the paged cache builds a few per request and forward)."""

    length: int
    sink_tokens: int  # S, the sinks' capacity
    packed_keys: int
    packed_values: int

    @property
    def sinks(self) -> int:
        """Sink tokens held."""
        return min(self.length, self.sink_tokens)

    @property
    def sinks_full(self) -> bool:
        return self.length >= self.sink_tokens

    @property
    def key_window(self) -> int:
        """Exact keys after the packed ones."""
        return self.length - self.sinks - self.packed_keys

    @property
    def value_window(self) -> int:
        """Exact values after the packed ones."""
        return self.length - self.sinks - self.packed_values

    def packed(self, kind: str) -> int:
        """Tokens of ``kind`` (``"keys"`` or ``"values"``) held as codes."""
        return self[_PACKED_FIELD[check_kind(kind)]]

    def window_start(self, kind: str) -> int:
        """Position of the first exact token of ``kind`` after the packed ones (``length`` when there is none)."""
        return self.sinks + self.packed(kind)

    def window(self, kind: str) -> int:
        """Exact tokens of ``kind`` after the packed ones."""
        return self.length - self.window_start(kind)

    def ranges(self, kind: str) -> tuple[range, range, range]:
        """(sinks, packed, window) positions of ``kind``."""
        s, packed, start = self.sink_tokens, self.packed(kind), self.window_start(kind)
        return range(self.sinks), range(s, s + packed), range(start, self.length)


KINDS = ("keys", "values")
_PACKED_FIELD = {"keys": TokenSplit._fields.index("packed_keys"), "values": TokenSplit._fields.index("packed_values")}


def check_kind(kind: str) -> str:
    """``kind`` if it names a kind (the API's per-kind questions; the code itself has a class per kind)."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be 'keys' or 'values', got {kind!r}")
    return kind


def _group_advice(head_dim: int, bits: int, which: str, field_prefix: str) -> str:
    """What a user can do when a group of ``bits``-bit codes does not fit ``head_dim``: the group sizes that work, or,
    when none does (a group is a whole number of bytes), the bits and group sizes that can quantize this head_dim."""

    def valid(b: int) -> list[int]:
        return [g for g in range(1, head_dim + 1) if head_dim % g == 0 and g % codes_per_byte(b) == 0]

    if valid(bits):
        return f"group sizes that work for {bits}-bit codes: {', '.join(map(str, valid(bits)))}"
    options = [f"`{field_prefix}_bits={b}` with `{field_prefix}_group_size` in {valid(b)}"
               for b in (4, 8) if b != bits and valid(b)]  # fmt: skip
    return (
        f"no group of {bits}-bit codes fits (a group is whole bytes of {codes_per_byte(bits)} codes and divides "
        f"head_dim), so these {which} cannot be quantized with {bits} bits: use "
        + " or ".join(options)
        + " (for one layer: `layer_overrides`)"
    )


@dataclass(frozen=True)
class KiviSettings:
    """Quantization settings of one cache layer (immutable; derive variants with :meth:`replace`).

    Args:
        bits: bits per quantized element, one of (2, 4, 8); the default for ``key_bits`` and ``value_bits``.
        group_size: ``G``, elements sharing one scale and zero point (tokens for keys, channels for values);
            the default for ``key_group_size`` and ``value_group_size``.
        residual_length: ``R``, tokens kept in full precision (the key block and the value window), at most
            ``2**24``; memory follows the tokens held, not ``R``.
        meta_dtype: dtype of the stored scales and zero points (``float16``, ``bfloat16`` or ``float32``), or
            ``None`` (default): the model's range, resolved at a layer's first update by :meth:`for_model_dtype`
            (``bfloat16`` for a bfloat16 model, whose keys may exceed float16's 65504; ``float16`` otherwise).
        key_bits / value_bits: bits of the key / value codes (default: ``bits``), each one of (2, 4, 8).
        key_group_size: tokens per key group (default: ``group_size``); divides ``R`` (keys are quantized in
            blocks of ``R`` tokens made of whole groups) and is a multiple of ``8 // key_bits``.
        value_group_size: channels per value group (default: ``group_size``); a multiple of ``8 // value_bits``.
        sink_tokens: ``S``, the first ``S`` tokens of the sequence are kept in full precision forever;
            ``0 <= S < R``; default: the preset's (4, the paper 0), at most ``R - 1`` (so that a small explicit
            ``residual_length`` is never rejected because of the default).
        rotation: how the packed history is rotated before it is quantized (:mod:`kivi_xpu.rotation`), one of
            ``ROTATIONS`` (``"none"``, ``"hadamard"``); the default for ``key_rotation`` and ``value_rotation``;
            default: the preset's (``"hadamard"``, the paper ``"none"``).
        key_rotation / value_rotation: the rotation of the keys / values (default: ``rotation``).
        fit: how each group's scale and zero point are chosen, one of ``FITS``: ``"minmax"`` (the group's range, as
            the paper) or ``"least_squares"`` (that line refit once to its codes: less error for the same bytes and
            the same dequantization; :mod:`kivi_xpu.ops.reference`); default: the preset's (``"least_squares"``,
            the paper ``"minmax"``).
        preset: ``"default"`` or ``"paper"`` (:data:`PRESETS`): the values of ``sink_tokens``, ``rotation`` and
            ``fit`` when they are not given.

    After construction ``key_bits``, ``value_bits``, ``key_group_size`` and ``value_group_size`` are ints and
    ``sink_tokens``, ``rotation``, ``key_rotation``, ``value_rotation`` and ``fit`` are resolved.
    Both group sizes must also divide the model's head_dim (:meth:`check_head_dim`). Derive variants with
    :meth:`replace` rather than ``dataclasses.replace``, which would pin the derived per-kind fields to their
    current values (``replace(bits=4)`` must also change ``key_bits`` when it was not given).
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    meta_dtype: torch.dtype | None = None
    _: KW_ONLY
    key_bits: int | None = None
    value_bits: int | None = None
    key_group_size: int | None = None
    value_group_size: int | None = None
    sink_tokens: int | None = None
    rotation: str | None = None
    key_rotation: str | None = None
    value_rotation: str | None = None
    fit: str | None = None
    preset: str = dataclasses.field(default="default", compare=False)  # only fills the fields above
    # The following fields as given (None = follow the shared field or the preset), so that `replace(bits=4)` or
    # `replace(preset="paper")` moves the derived ones along.
    _given: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        # Integers of any type (numpy, 0-d tensors) are stored as int: see kivi_xpu.validation.
        given = {name: getattr(self, name) for name in _FOLLOWING_FIELDS}
        object.__setattr__(
            self, "_given", tuple(v if v is None or k in _NAMED_FIELDS else integer(v, k) for k, v in given.items())
        )
        name_choice(self.preset, "preset", tuple(PRESETS))
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        object.__setattr__(self, "bits", check_bits(self.bits))
        object.__setattr__(self, "group_size", integer(self.group_size, "group_size", minimum=1))
        name_choice(self.rotation, "rotation", ROTATIONS)
        name_choice(self.fit, "fit", FITS)
        for name, shared in PER_KIND_FIELDS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, shared))
        object.__setattr__(self, "key_bits", check_bits(self.key_bits, self._name("key_bits")))
        object.__setattr__(self, "value_bits", check_bits(self.value_bits, self._name("value_bits")))
        for field, bits in (("key_group_size", self.key_bits), ("value_group_size", self.value_bits)):
            object.__setattr__(self, field, check_group_size(getattr(self, field), bits, self._name(field)))
        for field in ("key_rotation", "value_rotation"):
            name_choice(getattr(self, field), self._name(field), ROTATIONS)
        object.__setattr__(self, "residual_length", integer(self.residual_length, "residual_length", minimum=1))
        object.__setattr__(self, "sink_tokens", integer(self.sink_tokens, "sink_tokens", minimum=0))
        r = self.residual_length
        if r > MAX_RESIDUAL_LENGTH:
            raise ValueError(
                f"`residual_length` must be at most {MAX_RESIDUAL_LENGTH} (2**24 tokens, beyond any model's context; "
                f"a full-precision window that long takes >= 4 GiB per head at head_dim 128), got {r}"
            )
        if r % self.key_group_size != 0:
            name = self._name("key_group_size")
            raise ValueError(
                f"`residual_length` ({r}) must be a multiple of `{name}` ({self.key_group_size}): "
                "keys are quantized in blocks of residual_length tokens, each made of whole groups"
            )
        if given["sink_tokens"] is None:
            # The preset's sinks never reject an explicit window: at most R - 1 of them (every setting that accepted
            # the preset's 4 keeps them; R = 4 gets 3, R = 1 none).
            object.__setattr__(self, "sink_tokens", min(self.sink_tokens, r - 1))
        s = self.sink_tokens
        if s >= r:
            raise ValueError(
                f"`sink_tokens` ({s}) must be smaller than `residual_length` ({r}): the sinks are a few tokens "
                "kept exact, the residual window is the full-precision part of the streaming rule"
            )
        if self.meta_dtype is not None:
            check_meta_dtype(self.meta_dtype)

    def _name(self, field: str) -> str:
        """The argument a user set for ``field``: itself, or the shared field it was derived from."""
        given = dict(zip(_FOLLOWING_FIELDS, self._given, strict=True))
        return field if given[field] is not None else PER_KIND_FIELDS[field]

    def replace(self, **changes) -> KiviSettings:
        """A copy with ``changes`` applied (any constructor argument). Per-kind fields that were not given
        explicitly keep following ``bits`` / ``group_size`` / ``rotation``, and ``sink_tokens`` / ``rotation`` /
        ``fit`` the preset, when not given; unknown names raise ``ValueError``."""
        names = [f.name for f in dataclasses.fields(self) if f.init and f.name != "_"]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"unknown KiviSettings field(s) {unknown}; allowed: {names}")
        args = {name: getattr(self, name) for name in names}
        args.update(zip(_FOLLOWING_FIELDS, self._given, strict=True))
        args.update(changes)
        return KiviSettings(**args)

    def check_head_dim(self, head_dim: int, kind: str | None = None) -> None:
        """Checks that the key and value group sizes divide ``head_dim`` (only ``kind`` "keys"/"values" if given)."""
        checks = (("keys", "key", self.key_group_size, self.key_bits),
                  ("values", "value", self.value_group_size, self.value_bits))  # fmt: skip
        for which, prefix, group, bits in checks:
            if kind in (None, which) and head_dim % group != 0:
                raise ValueError(
                    f"`{self._name(prefix + '_group_size')}` ({group}) for the {which} must divide the model's "
                    f"head_dim ({head_dim}); " + _group_advice(head_dim, bits, which, prefix)
                )

    def quantized_key_count(self, total_tokens: int) -> int:
        """Keys held as codes when the layer holds ``total_tokens``: whole blocks of ``R`` after the sinks
        (positions ``[S, S + count)``)."""
        return max(0, total_tokens - self.sink_tokens) // self.residual_length * self.residual_length

    def quantized_value_count(self, total_tokens: int) -> int:
        """Values held as codes when the layer holds ``total_tokens``: all but the sinks and the newest ``R``
        (positions ``[S, S + count)``)."""
        return max(0, total_tokens - self.sink_tokens - self.residual_length)

    def split(self, length: int) -> TokenSplit:
        """The sinks, packed tokens and windows of each kind when the layer holds ``length`` tokens."""
        packed_keys, packed_values = self.quantized_key_count(length), self.quantized_value_count(length)
        return TokenSplit(length, self.sink_tokens, packed_keys, packed_values)

    def steady_appends(self, kind: str, total_tokens: int) -> int:
        """One-token appends from ``total_tokens`` held on, the first included, during which the count of ``kind``
        ("keys" or "values") held as codes grows by the same amount at each (what the one-call decode step relies on
        between two looks at the rule); ``UNBOUNDED`` when that never changes."""
        by_kind = {"keys": self.steady_key_appends, "values": self.steady_value_appends}
        return by_kind[check_kind(kind)](total_tokens)

    def steady_key_appends(self, total_tokens: int) -> int:
        """:meth:`steady_appends` of the keys: nothing is packed until the window completes a block of R, then a
        block at once."""
        s, r = self.sink_tokens, self.residual_length
        count = self.quantized_key_count(total_tokens)
        return 1 if self.quantized_key_count(total_tokens + 1) > count else s + count + r - 1 - total_tokens

    def steady_value_appends(self, total_tokens: int) -> int:
        """:meth:`steady_appends` of the values: one token at every append once the window holds R."""
        s, r = self.sink_tokens, self.residual_length
        return UNBOUNDED if total_tokens + 1 > s + r else s + r - total_tokens

    def for_model_dtype(self, dtype: torch.dtype) -> KiviSettings:
        """These settings with ``meta_dtype`` resolved for a model computing in ``dtype`` (themselves when it was
        given): bfloat16 scales and zeros for a bfloat16 model (keys of some bf16 models overflow float16, which
        makes their groups NaN; measured on SmolLM2-135M in bf16: no perplexity cost at 2, 4 or 8 bits), float16
        otherwise (as the paper)."""
        if self.meta_dtype is not None:
            return self
        return self.replace(meta_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)

    def _meta_bits(self) -> int:
        return 16 if self.meta_dtype is None else torch.finfo(self.meta_dtype).bits  # None: 16-bit either way

    def key_bits_per_element(self) -> float:
        """Storage bits of one quantized key element: ``key_bits + 2 * meta_bits / key_group_size``."""
        return self.key_bits + 2 * self._meta_bits() / self.key_group_size

    def value_bits_per_element(self) -> float:
        """Storage bits of one quantized value element: ``value_bits + 2 * meta_bits / value_group_size``."""
        return self.value_bits + 2 * self._meta_bits() / self.value_group_size

    def bits_per_element(self) -> float:
        """Storage bits of one quantized element, averaged over keys and values:
        ``((key_bits + 2 * meta_bits / key_group_size) + (value_bits + 2 * meta_bits / value_group_size)) / 2``
        (codes plus the element's share of its group's scale and zero point; ``meta_bits`` is 16 for fp16).
        The full-precision sinks and residual window are not included."""
        return (self.key_bits_per_element() + self.value_bits_per_element()) / 2


__all__ = ["KINDS", "KiviSettings", "META_DTYPES", "PER_KIND_FIELDS", "PRESETS", "ROTATIONS", "TokenSplit"]
