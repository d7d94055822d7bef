"""kivi_xpu._cpu.decode_attention against its pure-PyTorch twins on awkward shapes, on every ISA of this CPU and
both arithmetics: ``fp32`` (and the baseline ISA) against kivi_xpu.ops.reference.decode_attention, ``int8`` (the
integer dot products of AVX2 / AVX-512) against kivi_xpu.ops.integer_twin.decode_attention.

Skipped when the extension is not built, unless KIVI_XPU_REQUIRE_NATIVE=1 (then a missing build fails).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from attention_cases import CASES, Case, assert_close, build
from native_module import native

from kivi_xpu.integration import cache_argument
from kivi_xpu.ops import integer_twin
from kivi_xpu.ops.reference import decode_attention as decode_attention_reference
from kivi_xpu.runtime import attention_arithmetic


def integer_arithmetic() -> bool:
    """Whether the native op runs the integer path now (the int8 arithmetic on an ISA that has it)."""
    return attention_arithmetic(native) == "int8"


def twin(**args) -> torch.Tensor:
    """What the native op must compute with the current ISA and arithmetic."""
    if integer_arithmetic():
        return integer_twin.decode_attention(**args)
    return decode_attention_reference(**args)


@pytest.fixture(params=["int8", "fp32"])
def dot(request):
    """Runs a native-kernel test with one arithmetic, restoring the process's default afterwards."""
    previous = native.dot()
    native.set_dot(request.param)
    yield request.param
    native.set_dot(previous)


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"n{c.n}-s{c.sinks}-r{c.ratio}-L{c.length}-{c.mask}" + (f"-rot{c.rotated}" * bool(c.rotated)),
)
def test_matches_twin(isa, dot, case):
    args = build(case)
    out = native.decode_attention(**args)
    assert out.shape == (case.batch, case.kv_heads * case.ratio, case.length, case.value_dim)
    assert_close(out, twin(**args), integer_arithmetic())
    if case.mask != "none":  # the fully masked row gives zeros, never NaN
        assert torch.equal(out[0, :, -1], torch.zeros_like(out[0, :, -1]))


def test_an_empty_batch_gives_an_empty_output(isa, dot):
    case = Case(batch=0)
    args = build(case)
    out = native.decode_attention(**args)
    assert out.shape == (0, case.kv_heads * case.ratio, case.length, case.value_dim)
    assert torch.equal(out, decode_attention_reference(**args))


@pytest.mark.parametrize("where", ["tail", "sink", "packed"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_key_makes_the_row_nan(isa, dot, where, bad):
    case = Case(sinks=2, length=3, ratio=1, mask="bool")
    args = build(case)
    args["query"][..., 0] = 1.0  # every score meets the bad channel with a positive weight: +inf, not -inf
    args["mask"][:] = True
    args["mask"][1, 0, 2, :] = False  # a fully masked row stays zeros even so
    if where == "tail":
        args["key_tail"][0, 1, 3, 0] = bad
    elif where == "sink":
        args["key_sinks"][0, 1, 1, 0] = bad
    else:
        args["key_scales"][0, 1, 0, 1] = bad
    out = native.decode_attention(**args)
    assert_close(out, twin(**args), integer_arithmetic())
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any() and not out[1].isnan().any()
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))


def test_masked_nan_key_is_ignored(isa, dot):
    args = build(Case(mask="bool"))
    args["mask"][:] = True
    args["key_tail"][:, :, 5, :] = float("nan")
    args["mask"][..., args["mask"].shape[-1] - args["key_tail"].shape[2] + 5] = False
    out = native.decode_attention(**args)
    assert not out.isnan().any()
    assert_close(out, twin(**args), integer_arithmetic())


def test_deterministic_across_thread_counts():
    args = build(Case(batch=1, key_count=4096, value_count=4100, key_tail=100))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.decode_attention(**args)
        torch.set_num_threads(max(2, threads))
        many = native.decode_attention(**args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_phase_timers_split_a_call_and_change_nothing(isa, dot):
    """The kernel's phase timers (kivi-xpu bench --phases): off by default, the same output with them on, each
    phase of a call with sinks, packed history and tail timed, the factors within their parents (timed on the integer
    path only; contiguous metadata is read inside them, so the metadata phases stay at 0 here), and zeroed by a
    reset."""
    args = build(Case(sinks=4, key_count=256, value_count=260, key_tail=30))
    native.phase_seconds(reset=True)
    off = native.decode_attention(**args)
    assert set(native.phase_seconds(reset=False).values()) == {0.0}
    native.set_phase_timing(True)
    try:
        on = native.decode_attention(**args)
    finally:
        native.set_phase_timing(False)
    seconds = native.phase_seconds(reset=True)
    assert torch.equal(on, off)
    top = ("read_inputs", "exact_scores", "packed_scores", "softmax", "exact_values", "packed_values", "merge")
    assert all(seconds[name] > 0 for name in top), seconds
    within = {"packed_scores": ("key_meta", "key_factors"), "packed_values": ("value_meta", "value_factors")}
    for parent, (meta, factors) in within.items():
        assert (seconds[factors] > 0) == integer_arithmetic(), seconds
        assert seconds[meta] == 0.0, seconds  # whole blocks of contiguous storage: read by the factors
        assert seconds[meta] + seconds[factors] <= seconds[parent]
    assert set(native.phase_seconds().values()) == {0.0}


SCRIPT = """
import torch
from kivi_xpu import _cpu as native
from tests.test_native_attention import CASES, assert_close, build, integer_arithmetic, twin
assert native.isa() == {isa!r}, native.isa()
assert native.dot() == {dot!r}, native.dot()
for case in CASES[:6]:
    args = build(case)
    assert_close(native.decode_attention(**args), twin(**args), integer_arithmetic())
print("ok")
"""


def run_script(script: str, **environment: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests_dir = os.path.join(root, "tests")  # this module imports tests/native_module.py
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, tests_dir]), **environment)
    env.pop("KIVI_XPU_CPU_DOT", None) if "KIVI_XPU_CPU_DOT" not in environment else None
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)


@pytest.mark.parametrize("requested", native.available_isas())
@pytest.mark.parametrize("arithmetic", ["int8", "fp32", ""])
def test_environment_selects_the_isa_and_arithmetic(requested, arithmetic):
    result = run_script(
        SCRIPT.format(isa=requested, dot=arithmetic or "int8"), KIVI_XPU_CPU_ISA=requested, KIVI_XPU_CPU_DOT=arithmetic
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_environment_rejects_an_unknown_arithmetic():
    result = run_script(SCRIPT.format(isa=native.isa(), dot="int8"), KIVI_XPU_CPU_DOT="int4")
    assert result.returncode != 0 and "KIVI_XPU_CPU_DOT" in result.stderr and "int8, fp32" in result.stderr


def test_integer_path_is_taken_where_the_isa_has_it(isa):
    """int8 and fp32 differ by the 8-bit rounding on AVX2 / AVX-512 (so the twin tests above test two paths), and
    not at all on the baseline ISA, which has no integer path."""
    args = build(CASES[0])
    native.set_dot("int8")
    try:
        integer = native.decode_attention(**args)
    finally:
        native.set_dot("fp32")
    try:
        floats = native.decode_attention(**args)
    finally:
        native.set_dot("int8")
    assert torch.equal(integer, floats) == (isa == "baseline")


def bad_inputs():
    """(description, change to the arguments of a valid call, expected message fragment)."""
    yield "rank", lambda a: a.update(query=a["query"][0]), "`query` must have rank 4"
    yield "int query", lambda a: a.update(query=a["query"].int()), "`query` must be float32"
    yield "bits", lambda a: a.update(key_bits=3), "`key_bits` must be 2, 4 or 8"
    yield "key group", lambda a: a.update(key_group=30), "`key_group` must be a positive multiple"
    yield "key count", lambda a: a.update(key_count=48, key_tail=a["key_tail"][:, :, 16:]), "`key_count`"
    yield "too many keys", lambda a: a.update(key_count=1 << 20), "exceeds the stored keys"
    yield "too many values", lambda a: a.update(value_count=1 << 20), "`value_count`"
    yield "counts", lambda a: a.update(value_tail=a["value_tail"][:, :, 1:]), "but values cover"
    yield "heads", lambda a: a.update(query=a["query"][:, :4]), "multiple of the kv heads"
    yield "head_dim", lambda a: a.update(query=a["query"][..., :32]), "`key_codes` must have shape"
    yield "codes dtype", lambda a: a.update(key_codes=a["key_codes"].int()), "`key_codes` must be uint8"
    yield "meta dtypes", lambda a: a.update(key_zeros=a["key_zeros"].float()), "must share a dtype"
    yield "packed strides", lambda a: a.update(value_codes=a["value_codes"][:, :, ::2]), "must be contiguous"
    channel_major = lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)  # noqa: E731
    yield "tail stride", lambda a: a.update(key_tail=channel_major(a["key_tail"])), "unit stride"
    yield "sinks", lambda a: a.update(value_sinks=None), "`key_sinks` holds"
    yield "mask shape", lambda a: a.update(mask=torch.ones(1, 1, 1, 3, dtype=torch.bool)), "`mask` must have shape"
    yield "mask dtype", lambda a: a.update(mask=torch.ones(1, 1, 1, 200, dtype=torch.int32)), "`mask` must be float32"
    yield "softcap", lambda a: a.update(softcap=float("inf")), "`softcap` must be finite"


@pytest.mark.parametrize("what,change,message", list(bad_inputs()), ids=[b[0] for b in bad_inputs()])
def test_bad_input_raises(what, change, message):
    args = build(Case(sinks=2))
    change(args)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        native.decode_attention(**args)


def test_isa_override_rejects_unknown_names():
    with pytest.raises((RuntimeError, ValueError), match="expected one of"):
        native.set_isa("sse9")


def test_arithmetic_override_rejects_unknown_names():
    with pytest.raises(ValueError, match="expected one of int8, fp32"):
        native.set_dot("int4")


def test_fp16_model_with_fp16_tails(dot):
    case = replace(CASES[0], dtype=torch.float16, sinks=3, mask="bool")
    args = build(case)
    assert_close(native.decode_attention(**args), twin(**args), integer_arithmetic())


# Packed key codes, value codes and their metadata each placed so that they end exactly where a PROT_NONE page
# begins: a kernel reading one byte past them dies with SIGSEGV (in a child process, so the test reports it).
GUARD = """
import ctypes, mmap, torch
from kivi_xpu import _cpu as native
from kivi_xpu.ops.reference import quantize_keys, quantize_values
page = mmap.PAGESIZE
libc = ctypes.CDLL(None)


def guarded(t):
    '''A copy of `t` whose last byte is the last before a PROT_NONE page.'''
    memory = mmap.mmap(-1, 2 * page + t.numel() * t.element_size())
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    end = (start + len(memory)) // page * page - page
    assert libc.mprotect(ctypes.c_void_p(end), ctypes.c_size_t(page), 0) == 0
    size = t.numel() * t.element_size()
    copy = torch.frombuffer(memory, dtype=t.dtype, count=t.numel(), offset=end - start - size).view(t.shape)
    copy.copy_(t)
    return copy, memory
"""
GUARDED_ATTENTION = (
    GUARD
    + """
keep = []
for bits in (2, 4):
    for key_count, value_count in ((32, 1), (64, 33), (256, 259), (288, 290)):
        n = max(key_count, value_count) + 8
        keys = quantize_keys(torch.randn(1, 2, key_count, 64), 32, bits, torch.float16)
        values = quantize_values(torch.randn(1, 2, value_count, 64), 32, bits, torch.float16)
        guarded_keys = [guarded(t) for t in keys]
        guarded_values = [guarded(t) for t in values]
        keep += guarded_keys + guarded_values
        out = native.decode_attention(
            torch.randn(1, 6, 1, 64), None, *(g[0] for g in guarded_keys), key_count, 32, bits,
            torch.randn(1, 2, n - key_count, 64), None, *(g[0] for g in guarded_values), value_count, 32, bits,
            torch.randn(1, 2, n - value_count, 64), None, 0.125, None)
        assert out.isfinite().all()
print("ok")
"""
)


# Pages of continuous batching in a pool whose last block ends where a PROT_NONE page begins (its last section, the
# value zeros, fills whole cache lines: no padding after it), each request's last page that block.
GUARDED_PAGED_ATTENTION = (
    GUARD
    + """
from kivi_xpu.algorithm import KiviSettings
from kivi_xpu.paged.pages import LayerPages, PageLayout

H, D, T = 2, 64, 32
keep = []
for bits in (2, 4):
    settings = KiviSettings(key_bits=bits, value_bits=bits, key_group_size=T, value_group_size=32,
                            residual_length=T, meta_dtype=torch.float16, sink_tokens=0)
    layout = PageLayout.for_settings(settings, H, D)
    pool, memory = guarded(torch.zeros(3, layout.page_bytes, dtype=torch.uint8))
    keep.append(memory)
    pages = LayerPages(pool, layout, 0)
    zeros_end = layout.offsets()["value_zeros"] + pages.value_zeros[0].numel() * pages.value_zeros.element_size()
    assert zeros_end == layout.page_bytes, "the last block's value zeros must end at the guard page"
    for name in ("key_codes", "value_codes"):
        getattr(pages, name).copy_(torch.randint(0, 256, getattr(pages, name).shape, dtype=torch.uint8))
    for name in ("key_scales", "value_scales", "key_zeros", "value_zeros"):
        getattr(pages, name).copy_(torch.rand(getattr(pages, name).shape))
    for key_count, value_count in ((32, 1), (64, 33), (64, 64), (96, 96)):
        count = -(-max(key_count, value_count) // T)
        n = max(key_count, value_count) + 8
        table = torch.arange(3 - count, 3, dtype=torch.int64).view(1, count)
        requests = torch.tensor([[0, 0, key_count, 0, value_count, 0, n]], dtype=torch.int64)
        out = native.paged_decode_attention(
            torch.randn(1, 6, 1, D), torch.randn(1, H, n, D), torch.randn(1, H, n, D), pages.key_codes,
            pages.key_scales, pages.key_zeros, pages.value_codes, pages.value_scales, pages.value_zeros, table,
            requests, bits, 32, bits, 0.125, None, None)
        assert out.isfinite().all()
print("ok")
"""
)


@pytest.mark.parametrize("requested", native.available_isas())
@pytest.mark.parametrize("arithmetic", ["int8", "fp32"])
@pytest.mark.parametrize("script", ["contiguous", "paged"])
def test_reads_no_byte_past_the_packed_storage(requested, arithmetic, script):
    guarded = GUARDED_ATTENTION if script == "contiguous" else GUARDED_PAGED_ATTENTION
    result = run_script(guarded, KIVI_XPU_CPU_ISA=requested, KIVI_XPU_CPU_DOT=arithmetic)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


def test_integer_arithmetic_in_a_model_stays_close_to_fp32():
    """A tiny Llama scoring 160 tokens one at a time after a 100-token prompt (fused attention, 2-bit, G=32, R=32,
    the history quantized many times over): the int8 arithmetic's logits stay within a few percent of the fp32
    arithmetic's and pick the same next token almost everywhere (a wrong code order or scale would scatter them)."""
    from tiny_models import tiny_llama

    from kivi_xpu import KiviCache

    model = tiny_llama(0)
    model.set_attn_implementation("kivi")
    tokens = torch.randint(3, 256, (2, 260), generator=torch.Generator().manual_seed(0))
    logits = {}
    previous = native.dot()
    try:
        for arithmetic in ("fp32", "int8"):
            native.set_dot(arithmetic)
            cache = KiviCache(config=model.config, residual_length=32, group_size=32, backend="native")
            with torch.inference_mode():
                steps = [model(tokens[:, :100], **cache_argument(cache)).logits[:, -1]]
                for t in range(100, 259):
                    steps.append(model(tokens[:, t : t + 1], **cache_argument(cache)).logits[:, -1])
            logits[arithmetic] = torch.stack(steps, dim=1)
    finally:
        native.set_dot(previous)
    assert logits["fp32"].isfinite().all() and logits["int8"].isfinite().all()
    difference = (logits["int8"] - logits["fp32"]).abs().max() / logits["fp32"].abs().max()
    same_token = (logits["int8"].argmax(-1) == logits["fp32"].argmax(-1)).float().mean()
    if native.isa() == "baseline":  # no integer path: the same computation
        assert difference == 0
    else:
        assert 0 < difference < 0.05 and same_token >= 0.95, (difference.item(), same_token.item())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_value_metadata_propagates_as_in_the_twin(isa, dot, bad):
    """A NaN or Inf value scale makes the weights of its chunk non-finite: the integer path falls back to fp32 for
    that chunk, so the NaN / Inf outputs are those of the dense product."""
    args = build(Case(batch=1, kv_heads=2, key_count=288, value_count=300, key_tail=40))
    args["value_scales"][0, 1, 260, 0] = bad
    out = native.decode_attention(**args)
    expected = twin(**args)
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    assert not out[0, :3].isnan().any() and (out[0, 3:].isnan() | out[0, 3:].isinf()).any()
    finite = expected.isfinite()
    torch.testing.assert_close(out[finite], expected[finite], rtol=2e-3, atol=2e-3)
