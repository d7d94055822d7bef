"""The path rule: whether a KIVI layer hands its packed history to the fused attention or returns dense states.

A model runs the fused attention under ``attn_implementation="kivi"`` and under transformers' default attention
(no ``attn_implementation`` chosen), once its attention call has gone through kivi_xpu's ``"sdpa"`` function
(:mod:`.functions`); under any attention the user chose, ``"sdpa"`` included, a layer returns dense states.
"""

from __future__ import annotations

import functools
import logging

ATTENTION_NAME = "kivi"
logger = logging.getLogger("kivi_xpu")

# transformers' default attention, "sdpa" resolved because no attn_implementation was given, as a str object of its
# own: models built after `import kivi_xpu` hold this very object (kivi_xpu.integration records it at load), while a
# name the user chose, "sdpa" included, is another object. Under it a KiviCache takes the fused path.
DEFAULT_SDPA = "".join(("sd", "pa"))


def attention_name(config) -> str | None:
    """``config._attn_implementation``, read where transformers 5 stores it, past the config class's
    ``__getattribute__`` hooks, which would add their Python calls to every layer at every step; a config without
    that attribute is read the documented way."""
    try:
        return object.__getattribute__(config, "_attn_implementation_internal")
    except AttributeError:
        return getattr(config, "_attn_implementation", None)


def attention_path(config, seen: bool) -> tuple[bool, str]:
    """(fused, why) for a KIVI layer read by the model of ``config``: fused under ``attn_implementation="kivi"``,
    and under transformers' default attention once the layer's attention call went through the registered ``"sdpa"``
    function (``seen``: a model whose attention bypasses transformers' interface must get dense states); dense under
    any attention the user chose, ``"sdpa"`` included."""
    name = attention_name(config)
    if name == ATTENTION_NAME:
        return True, 'attn_implementation="kivi"'
    if name is DEFAULT_SDPA:
        if seen:
            return True, "the model runs transformers' default attention (no attn_implementation was chosen)"
        return False, "the model's attention has not reached transformers' attention interface yet"
    return False, (
        f"the model's attention is {name!r}, chosen explicitly (or the model was loaded before kivi_xpu was "
        "imported); kivi_xpu.use_fused_attention(model) switches to the fused attention"
    )


def fuses(config, seen: bool) -> bool:
    """``attention_path(config, seen)[0]`` on the hot path (every layer, every step)."""
    name = attention_name(config)
    return name == ATTENTION_NAME or (seen and name is DEFAULT_SDPA)


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


def log_attention_path(layer) -> None:
    """Says once per process in the log (logger ``kivi_xpu``, level INFO) which attention and kernels read the
    history of layers like ``layer``."""
    if layer.attention == "dense":
        fused, why = False, 'the cache was built with attention="dense"'
    else:
        fused, why = attention_path(layer.model_config, layer.attention_seen)
    path = "fused KIVI attention over the packed history" if fused else "SDPA over a dequantized copy"
    _say_once(f"kivi_xpu: {path} ({why}); kernels: {layer.backend.describe()}")
