"""Continued conversations without their prefill: the recent conversations' caches, kept for the next turn.

A chat's next request is the whole conversation so far (the earlier prompts and answers) and a new question. Sent to
``model.generate`` with a fresh cache, it pays the prefill of all of it again at every turn. :class:`Conversations`
keeps the :class:`~kivi_xpu.KiviCache` of each recent ``generate`` keyed by the tokens it holds (the prompt and the
answer but its last token, which was never fed back), and :func:`remember_conversations` makes ``model.generate`` hand
a request whose tokens begin with such a sequence its cache: only the new tokens are prefilled.

The contract: the answer is the one a program gets by keeping one ``KiviCache`` across the turns (docs/usage.md, "one
cache across chat turns"): the cached tokens are attended as that cache holds them (the older ones packed, as they
were when the previous answer was generated), not as a prefill of the whole conversation would hold them. A cache is
reused only when every token it holds begins the new request (a chat template that tokenizes the previous answer
otherwise gets a fresh cache: its tokens differ from those the cache holds). A reused cache leaves the store; the
request's cache then takes its place.

Memory: at most ``max_bytes`` of caches (their allocated bytes, :meth:`KiviCache.memory_report
<kivi_xpu.KiviCache.memory_report>`), the least recently used (by a logical clock) dropped first; a cache larger
than the bound is not kept.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import NamedTuple

import torch

from .cache import KiviCache
from .integration import CACHE_KEY, HANDED_OVER, build_cache

logger = logging.getLogger("kivi_xpu")


class Kept(NamedTuple):
    cache: KiviCache
    nbytes: int
    used: int  # the logical clock when it was stored


class Conversations:
    """The caches of recent conversations, keyed by the tokens each holds, within ``max_bytes`` (see the module
    docstring). Safe to share between threads."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"`max_bytes` must be a non-negative number of bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._kept: dict[tuple[int, ...], Kept] = {}
        self._clock = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        """Bytes of the caches kept."""
        return sum(kept.nbytes for kept in self._kept.values())

    def take(self, tokens: list[int]) -> tuple[KiviCache, int] | None:
        """The cache of the longest kept sequence that begins ``tokens`` and is shorter than them, with its length,
        removed from the store; ``None`` when none does."""
        with self._lock:
            best = None
            for held in self._kept:
                longer = best is None or len(held) > len(best)
                if longer and len(held) < len(tokens) and tuple(tokens[: len(held)]) == held:
                    best = held
            if best is None:
                return None
            return self._kept.pop(best).cache, len(best)

    def put(self, tokens: tuple[int, ...], cache: KiviCache) -> None:
        """Keeps ``cache``, which holds ``tokens``, dropping the least recently used caches while over the bound."""
        nbytes = cache.memory_report().allocated_bytes
        with self._lock:
            self._kept.pop(tokens, None)
            if nbytes > self.max_bytes:
                return
            while self._kept and self.nbytes + nbytes > self.max_bytes:
                oldest = min(self._kept, key=lambda held: self._kept[held].used)
                del self._kept[oldest]
            self._clock += 1
            self._kept[tokens] = Kept(cache, nbytes, self._clock)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


def remember_conversations(model, conversations: Conversations) -> None:
    """Makes ``model.generate`` continue from ``conversations``: a call of one sequence whose generation config asks
    for the KIVI cache (``cache_implementation="kivi"``) and that brings no cache of its own gets the kept cache of
    the longest sequence its tokens begin with, or a new one, and its cache is kept afterwards (see the module
    docstring). Other calls go to ``generate`` unchanged."""
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        return _generate(model, original, conversations, *args, **kwargs)

    model.generate = generate


def _generate(model, original, conversations: Conversations, *args, **kwargs):
    config = kwargs.get("generation_config") or model.generation_config
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    own_cache = kwargs.get(CACHE_KEY) is not None or kwargs.get("past_key_values") is not None
    if (
        own_cache
        or getattr(config, "cache_implementation", None) != "kivi"
        or not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.shape[0] != 1
    ):
        return original(*args, **kwargs)
    tokens = input_ids[0].tolist()
    found = conversations.take(tokens)
    if found is None:
        cache, reused = build_cache(model, config.cache_config), 0
    else:
        cache, reused = found
        logger.info(f"kivi_xpu: a conversation continued: {reused} of {len(tokens)} prompt tokens reused")
    HANDED_OVER.add(cache)  # (generate's cache_implementation="kivi" then takes it as it is)
    kwargs = {**kwargs, CACHE_KEY: cache}
    if kwargs.get("attention_mask") is None:  # (generate feeds only the tokens after the cache's when given one)
        kwargs["attention_mask"] = torch.ones_like(input_ids)
    out = original(*args, **kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    held = cache.get_seq_length()
    conversations.put(tuple(sequences[0, :held].tolist()), cache)
    return out
