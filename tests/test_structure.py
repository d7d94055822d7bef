"""The structure of a token's path (docs/development.md, "A token's path"): the modules a key goes through, kinds as
types, storage as a leaf, one codec, and one owner of each count, checked after every step of fuzzed runs."""

import ast
import importlib.util
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_backend

from kivi_xpu import KiviLayer, KiviSettings
from kivi_xpu.backend import select

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kivi_xpu"


def _sources_outside_ops() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "ops"
    }


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of what ``path`` imports (relative imports resolved within kivi_xpu)."""
    package = ["kivi_xpu", *path.relative_to(PACKAGE).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            names.add(".".join([*base, *([node.module] if node.module else [])]))
    return names


def test_storage_is_a_leaf():
    """storage.py knows bytes and rows: it imports torch and the standard library only."""
    imported = {name.split(".")[0] for name in _imported_modules(PACKAGE / "storage.py")}
    assert imported <= {"torch", *sys.stdlib_module_names}, imported


def test_the_streams_do_not_import_the_attention():
    assert not any(name.startswith("kivi_xpu.attention") for name in _imported_modules(PACKAGE / "stream.py"))


def test_only_the_codec_calls_the_quantize_and_dequantize_ops():
    op_call = re.compile(r'"(de)?quantize_(keys|values)(_into)?"|f"(de)?quantize_|\.(de)?quantize_(keys|values)\w*\(')
    callers = {name for name, text in _sources_outside_ops().items() if op_call.search(text)}
    assert callers == {"codec.py"}


def test_kinds_are_types_not_strings():
    """Outside ops/ (whose op registry builds argument names from kinds), no code compares a kind's name or builds
    a name from it: the kinds are KeyStream / ValueStream and KeyCodec / ValueCodec."""
    patterns = (
        r"""(kind|which|name) [!=]= ["'](keys?|values?)["']""",
        r""""key" if .* ==""",
        r"""getattr\(\w+, f["']\{kind\}_""",
    )
    found = [
        f"{name}:{number}"
        for name, text in _sources_outside_ops().items()
        for number, line in enumerate(text.splitlines(), 1)
        if any(re.search(p, line) for p in patterns)
    ]
    assert found == []


def _tracer():
    spec = importlib.util.spec_from_file_location("trace_token_path", ROOT / "benchmarks" / "trace_token_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("step", ("first", "run-start", "flush", "steady"))
def test_a_keys_path_goes_down_the_modules(step):
    """From KiviLayer.update a key goes down layer -> stream -> codec -> ops and storage, and comes back only by
    returning: at most 12 module stays and 3 returns to a module already left (6 stays for a steady step)."""
    require_backend("native")  # (its decode step is one call with no Python frame; the reference's is Python)
    tracer = _tracer()
    path = tracer.token_path(step, "native")
    shown = "\n".join(f"{module}: {', '.join(functions)}" for module, functions in path)
    assert len(path) <= (6 if step == "steady" else 12), shown
    assert tracer.returns(path) <= (0 if step == "steady" else 3), shown


def _check_counts(layer: KiviLayer) -> None:
    """One owner of each count: a stream's length is its sinks, packed and window rows, split as the rule splits
    it; the packed history's count is what its buffers hold."""
    split = layer.settings.split(layer.cumulative_length)
    for stream in layer._streams():
        packed, layout = stream.packed, stream.packed.layout
        assert stream.length == split.length == len(stream.sinks) + packed.num_tokens + len(stream.window)
        assert len(stream.sinks) == split.sinks and packed.num_tokens == stream.packed_in(split)
        assert (
            len(packed.scales) * layout.tokens_per_meta_row
            == packed.num_tokens
            == len(packed.zeros) * (layout.tokens_per_meta_row)
        )
        assert len(packed.codes) * layout.tokens_per_code_row == packed.num_tokens
        assert len(stream.departed) <= packed.num_tokens


@pytest.mark.parametrize("seed", range(3))
def test_every_count_has_one_owner_after_every_step_of_a_fuzzed_run(backend_name, seed):
    """Appends of 1-40 tokens (decode steps in runs, key blocks flushed), crops while recording or not, and batch
    selects, in random order: the counts agree after every step, for both kinds."""
    rng = random.Random(seed)
    settings = KiviSettings(2, 8, 16, sink_tokens=rng.choice((0, 3)), rotation=rng.choice(("none", "hadamard")))
    layer = KiviLayer(settings, select(backend_name))
    batch, heads, dim = 3, 2, 32
    for _ in range(150):
        action = rng.choices(("decode", "append", "crop", "record", "select"), weights=(70, 10, 8, 6, 6))[0]
        if action == "decode" or (action != "append" and not layer.cumulative_length):
            layer.update(torch.randn(batch, heads, 1, dim), torch.randn(batch, heads, 1, dim))
        elif action == "append":
            m = rng.randint(2, 40)
            layer.update(torch.randn(batch, heads, m, dim), torch.randn(batch, heads, m, dim))
        elif action == "crop":
            layer.crop(-rng.randint(0, min(20, layer.cumulative_length)))
        elif action == "record":
            layer.record_past = not layer.record_past
        else:
            index = torch.tensor([rng.randrange(batch) for _ in range(batch)])
            layer.batch_select_indices(index)
        _check_counts(layer)
