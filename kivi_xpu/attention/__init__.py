"""Fused KIVI attention for transformers: attention computed straight from the packed history.

A :class:`~kivi_xpu.KiviCache` layer under the fused attention returns from ``update`` only the full-precision tail
(window + new tokens) and hands over a :class:`~kivi_xpu.ops.operands.DecodeInputs` (the sinks, the packed history in
place and the tails) to the attention function, which reads the packed codes in place. One concern a module:

* :mod:`.path`: the rule (fused or dense, :func:`attention_path`) and its log line;
* :mod:`.hand_over`: the slot between ``update`` and the attention call (:func:`hand_over`, :func:`take_over`);
* :mod:`.functions`: the ``"kivi"`` and default ``"sdpa"`` attention functions and their registration.
"""

from ..codec import dense_states
from ..ops.operands import DecodeInputs
from .functions import (
    attention_with_weights,
    decode_attention,
    default_attention_forward,
    kivi_attention_forward,
    register,
    use_fused_attention,
)
from .hand_over import Pending, hand_over, pending_step, take_over
from .path import ATTENTION_NAME, DEFAULT_SDPA, _say_once, attention_name, attention_path, fuses, log_attention_path

__all__ = [
    "ATTENTION_NAME",
    "DEFAULT_SDPA",
    "DecodeInputs",
    "Pending",
    "_say_once",
    "attention_name",
    "attention_path",
    "attention_with_weights",
    "decode_attention",
    "default_attention_forward",
    "dense_states",
    "fuses",
    "hand_over",
    "kivi_attention_forward",
    "log_attention_path",
    "pending_step",
    "register",
    "take_over",
    "use_fused_attention",
]
