"""Command-line plumbing shared by ``kivi-xpu bench`` and ``kivi-xpu eval-ppl``: argument types and groups, progress
bars, process options, and running a tool so that a :class:`ToolError` is one ``error:`` line with exit code 2."""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections.abc import Callable

import torch
import transformers

from ..backend import BACKENDS
from .options import CACHE_NAMES, DEVICE_FORMS, DTYPES, ToolError, ToolOptions

DEFAULTS = ToolOptions()


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_ints(text: str) -> list[int]:
    """``"1024,4096"`` (or one number): positive integers separated by commas."""
    return [positive_int(part) for part in text.split(",")]


class Flatten(argparse.Action):
    """``nargs="+"`` of :func:`positive_ints`: ``--contexts 512 1024`` and ``--contexts 512,1024`` alike."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for group in values for v in group])


def add_positive_ints(p: argparse.ArgumentParser, flag: str, default: list[int], help: str) -> None:
    """``flag`` taking positive integers, space- or comma-separated (:class:`Flatten`)."""
    p.add_argument(flag, type=positive_ints, nargs="+", action=Flatten, default=default, help=help)


# KiviCache arguments with a flag of their own in every tool (add_kivi_arguments): what --kivi-option says instead.
KIVI_FLAGS = {
    "bits": "use --bits",
    "group_size": "use --group-size",
    "residual_length": "use --residual-length",
    "meta_dtype": "use --meta-dtype",
    "backend": "use --backend",
    "device": "use --sycl-device",
}
# KiviCache arguments the bench tools set themselves.
OWN_FLAGS = KIVI_FLAGS | {
    "attention": "the cache names choose it (kivi-fused, kivi-dense)",
    "config": "the tool passes the model's config",
}


def kivi_option(text: str, own_flags: dict[str, str] = OWN_FLAGS) -> tuple[str, object]:
    """``NAME=VALUE`` for an extra ``KiviCache`` keyword argument; VALUE is a Python literal (``4``, ``True``),
    a torch dtype name (``float32``) or else a string. A NAME in ``own_flags`` is refused with its message."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a KiviCache keyword argument), got {text!r}")
    if name in own_flags:  # one source per setting, so the labels, the JSON and the HF caches agree with the run
        raise argparse.ArgumentTypeError(f"{name!r} is not a --kivi-option: {own_flags[name]}")
    if raw in DTYPES or raw.removeprefix("torch.") in DTYPES:
        return name, DTYPES[raw.removeprefix("torch.")]
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULTS.model,
        help="HF model id or local checkpoint directory; 'smollm2' (default) = SmolLM2-135M-Instruct obtained "
        "through pip and converted once (kivi_xpu.assets.smollm2_checkpoint); bench also takes a public model shape "
        "with random weights: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-7b (kivi_xpu.tools.shapes)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default=DEFAULTS.dtype, help="model dtype (default float32)")
    p.add_argument(
        "--device",
        default=DEFAULTS.device,
        help=f"where the model runs: a torch device such as {DEVICE_FORMS} (default {DEFAULTS.device}); the SYCL "
        "device filter of the KIVI kernels is --sycl-device",
    )
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--caches",
        nargs="+",
        choices=CACHE_NAMES,
        default=DEFAULTS.caches,
        metavar="CACHE",
        help=f"caches to compare, from {', '.join(CACHE_NAMES)} (default: all; quanto/hqq when installed)",
    )
    add_positive_ints(
        p,
        "--bits",
        DEFAULTS.bits,
        "bit widths: every quantized cache runs at each (default 2; KIVI takes 2, 4, 8; quanto 2, 4; hqq "
        "1, 2, 3, 4, 8)",
    )
    add_kivi_arguments(p)


def add_kivi_arguments(
    p: argparse.ArgumentParser, *, own_flags: dict[str, str] = OWN_FLAGS, defaults: bool = True
) -> None:
    """The KIVI settings besides the bit width: --group-size, --residual-length, --meta-dtype, --kivi-option,
    --backend and --sycl-device (the SYCL device filter, ``KiviCache``'s ``device``; --device is the model's device
    in every tool). ``own_flags``: the ``KiviCache`` arguments --kivi-option refuses, with the flag to use instead.
    ``defaults=False``: a setting not given is absent from the namespace (so that ``KiviCache``'s own default
    applies) instead of taking the tools' default."""

    def default(value):
        return value if defaults else argparse.SUPPRESS

    def shown(text: str) -> str:
        return f" ({text})" if defaults else f" (default: KiviCache's, {text})"

    p.add_argument(
        "--group-size",
        type=positive_int,
        default=default(DEFAULTS.group_size),
        help="G: elements per scale/zero group" + shown("32"),
    )
    p.add_argument(
        "--residual-length",
        type=positive_int,
        default=default(DEFAULTS.residual_length),
        help="R: newest tokens kept in full precision" + shown("128"),
    )
    p.add_argument(
        "--meta-dtype",
        choices=tuple(DTYPES),
        default=default(DEFAULTS.meta_dtype),
        help="KIVI scales/zeros dtype (default: KiviCache's, bfloat16 for a bfloat16 model, else float16)",
    )
    p.add_argument(
        "--kivi-option",
        dest="kivi_options",
        type=functools.partial(kivi_option, own_flags=own_flags),
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra KiviCache keyword argument (repeatable), passed through unchanged",
    )
    p.add_argument("--backend", choices=BACKENDS, default=default(None), help="KIVI kernels (default: auto)")
    p.add_argument(
        "--sycl-device",
        dest="sycl_device",
        default=default(None),
        help="SYCL device filter of the KIVI kernels, e.g. opencl:cpu or level_zero:gpu:0 (default: "
        "$KIVI_XPU_DEVICE or automatic)",
    )


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (only when the run completes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


class _NoBar:
    """Stand-in for a tqdm bar when progress is off or tqdm is not installed."""

    def __init__(self, iterable=None, **_):
        self.iterable, self.n = iterable, 0

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, s):
        pass

    def set_description_str(self, s):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress(enabled: bool, iterable=None, **kwargs):
    """A tqdm bar on stderr (``_NoBar`` when disabled or tqdm is missing)."""
    if not enabled:
        return _NoBar(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kwargs)


def first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:400]


def apply_process_options(options: ToolOptions) -> None:
    """``--threads``; ``--no-progress`` also silences transformers' own progress bars (weight loading)."""
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.no_progress:
        transformers.utils.logging.disable_progress_bar()


def run_tool(command: Callable, args) -> int:
    """Runs a tool command: ``ToolError`` becomes one ``error: ...`` line on stderr and exit code 2."""
    try:
        command(args)
    except ToolError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def tool_main(module: str, description: str, add_arguments: Callable, command: Callable, argv=None) -> int:
    """``python -m <module>`` of a tool: its arguments parsed from ``argv``, then :func:`run_tool`."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run_tool(command, parser.parse_args(argv))
