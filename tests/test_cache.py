"""KiviLayer / KiviCache: the paper's streaming rule after every step, crop, batch operations, memory,
validation. Run on the reference backend and, where available, the SYCL backend. The caches here are
``preset="paper"`` (the KIVI authors' algorithm, pinned bit for bit); the default preset's options are tested in
test_options.py and test_rotation.py."""

import copy
import pickle
import random

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, GPT2Config, LlamaConfig, LlamaForCausalLM

from kivi_xpu import KiviCache, KiviLayer, KiviSettings
from kivi_xpu.backend import select
from kivi_xpu.ops import reference as ref
from kivi_xpu.storage import CLASSES_PER_DOUBLING, TokenBuffer, size_class
from kivi_xpu.stream import KindStream, SteadyRun

B, H, D = 2, 3, 64


def make_layer(backend_name, bits=2, group_size=16, residual_length=32):
    return KiviLayer(KiviSettings(bits, group_size, residual_length, preset="paper"), select(backend_name))


def expected_dense(keys, values, held, settings):
    """The paper's rule, computed independently: what attention should read when ``held`` tokens were
    already stored and ``keys/values [B, H, n, D]`` hold every token so far (old and new)."""
    s = settings.for_model_dtype(keys.dtype)
    qk, qv = s.quantized_key_count(held), s.quantized_value_count(held)
    k, v = keys.clone(), values.clone()
    if qk:
        c, sc, z = ref.quantize_keys(keys[:, :, :qk], s.group_size, s.bits, s.meta_dtype)
        k[:, :, :qk] = ref.dequantize_keys(c, sc, z, qk, s.group_size, s.bits, keys.dtype)
    if qv:
        c, sc, z = ref.quantize_values(values[:, :, :qv], s.group_size, s.bits, s.meta_dtype)
        v[:, :, :qv] = ref.dequantize_values(c, sc, z, qv, s.group_size, s.bits, values.dtype)
    return k, v


def check_counts(layer, n):
    s = layer.settings
    assert layer.get_seq_length() == n
    assert layer.keys_stream.packed.num_tokens == s.quantized_key_count(n) == n // s.residual_length * s.residual_length
    assert len(layer.keys_stream.window) == n % s.residual_length
    assert layer.values_stream.packed.num_tokens == s.quantized_value_count(n) == max(0, n - s.residual_length)
    assert len(layer.values_stream.window) == min(n, s.residual_length)


@pytest.mark.parametrize("seed", range(3))
def test_streaming_rule_after_every_step(backend_name, seed):
    rng = random.Random(seed)
    layer = make_layer(backend_name, bits=rng.choice((2, 4, 8)))
    total = 400
    keys, values = torch.randn(B, H, total, D), torch.randn(B, H, total, D)
    n = 0
    # A prefill of random length, then single-token decode steps with multi-token appends mixed in.
    sizes = [rng.randint(1, 80)]
    while sum(sizes) < total:
        sizes.append(min(total - sum(sizes), rng.choice((1, 1, 1, 1, 2, 5, 37))))
    for m in sizes:
        k_out, v_out = layer.update(keys[:, :, n : n + m], values[:, :, n : n + m])
        k_exp, v_exp = expected_dense(keys[:, :, : n + m], values[:, :, : n + m], n, layer.settings)
        assert torch.equal(k_out, k_exp) and torch.equal(v_out, v_exp)
        n += m
        check_counts(layer, n)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_one_call_decode_step_equals_the_general_path(backend_name, dtype, monkeypatch):
    """A decode step through append_decode_step leaves the layer exactly as the general path (append_and_read)
    does, with sinks and a rotation, across key blocks, value departures, window moves and storage growth."""
    settings = KiviSettings(2, 16, 32, sink_tokens=4, rotation="hadamard")
    fast, general = (KiviLayer(settings, select(backend_name)) for _ in range(2))
    monkeypatch.setattr(general, "_steady_step", lambda keys, values: None)  # (was _decode_step)
    one_call_steps = []  # what each SteadyRun.step gave (None: the run had ended)
    step = SteadyRun.step

    def counted(run, *states):
        one_call_steps.append(step(run, *states))
        return one_call_steps[-1]

    monkeypatch.setattr(SteadyRun, "step", counted)
    sizes = [3, 1, 1, 1, 20] + [1] * 150 + [3] + [1] * 40
    keys, values = torch.randn(B, H, sum(sizes), D, dtype=dtype), torch.randn(B, H, sum(sizes), D, dtype=dtype)
    n = 0
    for m in sizes:
        got = fast.update(keys[:, :, n : n + m], values[:, :, n : n + m])
        expected = general.update(keys[:, :, n : n + m], values[:, :, n : n + m])
        n += m
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), n
        assert torch.equal(fast.keys, general.keys) and torch.equal(fast.values, general.values), n
    counts = [(layer.keys_stream.packed.num_tokens, layer.values_stream.packed.num_tokens) for layer in (fast, general)]
    assert counts[0] == counts[1] == (settings.quantized_key_count(n), settings.quantized_value_count(n))
    taken = sum(inputs is not None for inputs in one_call_steps)
    assert taken == 193 - 7  # of the 193 single tokens, not: sinks not yet full (1), packing a key block (6)


def test_decode_steps_look_at_the_rule_once_per_steady_run(backend_name, monkeypatch):
    """The one-call step looks at the streaming rule and at the buffers' room once per run of steps that move as
    many tokens into rows already there (until a key block leaves, a window moves its rows, storage grows), not at
    every step; test_one_call_decode_step_equals_the_general_path checks what the steps leave."""
    layer = KiviLayer(KiviSettings(2, 16, 32, sink_tokens=4, rotation="hadamard"), select(backend_name))
    looks = []
    steady = KindStream.steady

    def counted(self):  # (the budget is worked out in KindStream.steady: its plans are the looks)
        plan = steady(self)
        if plan is not None:
            looks.append(self.kind)
        return plan

    monkeypatch.setattr(KindStream, "steady", counted)
    layer.update(torch.randn(B, H, 40, D), torch.randn(B, H, 40, D))
    for _ in range(320):
        layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
    counts = layer.settings.quantized_key_count(360), layer.settings.quantized_value_count(360)
    assert (layer.keys_stream.packed.num_tokens, layer.values_stream.packed.num_tokens) == counts
    # keys: once after each of the 10 key blocks (and while the window grows); values: also at every window move
    # (every R steps) and storage growth (by GROWTH_FACTOR: a few tokens at these lengths). Every step: ~316 each.
    assert 10 <= looks.count("keys") <= 20 and 10 <= looks.count("values") <= 80, looks


def test_steady_decode_steps_begun_under_inference_mode_end_with_it(backend_name):
    """Buffers made under torch.inference_mode refuse in-place writes outside it: a run of steady steps begun
    inside it ends when the mode does (the layer copies them then), and the layer stores what it would without it."""
    settings = KiviSettings(2, 16, 32, sink_tokens=4, rotation="hadamard")
    inside, outside = (KiviLayer(settings, select(backend_name)) for _ in range(2))
    keys, values = torch.randn(B, H, 200, D), torch.randn(B, H, 200, D)
    # a prefill and 55 steps inside the mode (to 95 tokens: within a run of both kinds), 50 outside it, 55 inside
    modes = [torch.inference_mode] * 56 + [torch.no_grad] * 50 + [torch.inference_mode] * 55
    n = 0
    for mode in modes:
        m = 40 if n == 0 else 1
        k, v = keys[:, :, n : n + m], values[:, :, n : n + m]
        with mode():
            got = inside.update(k, v)
        with torch.no_grad():
            expected = outside.update(k, v)
        n += m
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), n
    assert torch.equal(inside.keys, outside.keys) and torch.equal(inside.values, outside.values)


@pytest.mark.parametrize("how", ("deepcopy", "pickle", "reset"))
def test_a_layer_copied_or_reset_during_a_steady_run_steps_on_its_own_buffers(backend_name, how):
    """The steady run a layer keeps between decode steps holds its buffers and the native function: a copy leaves it
    out (and builds its own on its own buffers), and reset drops it with the streams."""
    settings = KiviSettings(2, 16, 32, sink_tokens=4, rotation="hadamard")
    layer, twin = (KiviLayer(settings, select(backend_name)) for _ in range(2))
    keys, values = torch.randn(B, H, 120, D), torch.randn(B, H, 120, D)
    sizes = [40] + [1] * 50 if how != "reset" else [40] + [1] * 20
    n = 0
    for m in sizes:  # into a steady run (the window is full after 32 steps: one value token leaves per step)
        layer.update(keys[:, :, n : n + m], values[:, :, n : n + m])
        twin.update(keys[:, :, n : n + m], values[:, :, n : n + m])
        n += m
    assert layer._steady_run is not None and layer._steady_run.key_steps > 0
    if how == "reset":
        layer.reset()
        twin = KiviLayer(settings, select(backend_name))
        n = 60  # a new sequence, a different batch
        keys, values = torch.randn(1, H, 120, D), torch.randn(1, H, 120, D)
        for layer_ in (layer, twin):
            layer_.update(keys[:, :, :n], values[:, :, :n])
    else:
        copied = copy.deepcopy(layer) if how == "deepcopy" else pickle.loads(pickle.dumps(layer))
        assert copied._steady_run is None
        layer, twin = copied, layer  # the copy steps alongside the original
    for _ in range(30):
        got = layer.update(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        expected = twin.update(keys[:, :, n : n + 1], values[:, :, n : n + 1])
        n += 1
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), n
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values)
    own, other = ([b.data for s in x._streams() for b in (s.window, *s.packed.buffers())] for x in (layer, twin))
    assert {t.data_ptr() for t in own}.isdisjoint(t.data_ptr() for t in other)
    run = layer._steady_run  # (its operands are named slots since the streams became one class per kind)
    held = [
        t for t in (getattr(run, name) for name in SteadyRun.__slots__) if isinstance(t, torch.Tensor) and t.dim() == 4
    ]
    assert len(held) == 5 and all(any(t is b for b in own) for t in held)  # windows and value storage: its own


def test_a_cache_reaches_only_the_storage_it_accounts_for(backend_name):
    """Across decode steps of both paths (storage growth, key blocks, window moves), nothing the layer keeps between
    steps holds a replaced buffer alive or adds storage that memory_report does not count."""
    from kivi_xpu.tools.memory import kv_bytes

    cache = KiviCache(group_size=16, residual_length=32, backend=backend_name, sink_tokens=4, rotation="hadamard")
    cache.update(torch.randn(B, H, 40, D), torch.randn(B, H, 40, D), 0)
    for step in range(300):
        cache.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), 0)
        if step % 37 == 0 or step == 299:
            assert kv_bytes(cache).check == "ok", step


def test_update_checks_states_again_after_a_batch_change():
    layer = make_layer("reference")
    layer.update(torch.randn(1, H, 40, D), torch.randn(1, H, 40, D))
    layer.update(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))  # (the decode signature passes from now on)
    layer.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match="holds states of batch 2"):
        layer.update(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))


def test_prefill_returns_exact_states_and_splits_like_the_paper(backend_name):
    layer = make_layer(backend_name, residual_length=32)
    keys, values = torch.randn(B, H, 100, D), torch.randn(B, H, 100, D)
    k_out, v_out = layer.update(keys, values)
    assert k_out is keys and v_out is values
    check_counts(layer, 100)  # keys: 96 quantized + 4 exact; values: 68 quantized + 32 exact


def test_crop_of_unquantized_tokens_is_exact(backend_name):
    # While nothing left the full-precision windows, a crop leaves no trace at all.
    a, b = make_layer(backend_name, residual_length=32), make_layer(backend_name, residual_length=32)
    keys, values = torch.randn(B, H, 60, D), torch.randn(B, H, 60, D)
    a.update(keys[:, :, :20], values[:, :, :20])
    a.update(keys[:, :, 20:25], values[:, :, 20:25])  # candidate tokens to reject
    a.crop(-5)
    b.update(keys[:, :, :20], values[:, :, :20])
    check_counts(a, 20)
    for start, stop in ((25, 27), (27, 60)):
        out_a = a.update(keys[:, :, start:stop], values[:, :, start:stop])
        out_b = b.update(keys[:, :, start:stop], values[:, :, start:stop])
        assert torch.equal(out_a[0], out_b[0]) and torch.equal(out_a[1], out_b[1])


@pytest.mark.parametrize("remove", [1, 5, 31, 33, 64, 90, 200])
def test_crop_across_quantized_groups_restores_the_rule(backend_name, remove):
    layer = make_layer(backend_name, residual_length=32)
    keys, values = torch.randn(B, H, 130, D), torch.randn(B, H, 130, D)
    layer.update(keys[:, :, :100], values[:, :, :100])
    for t in range(100, 130):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    seen_k, seen_v = layer.update(keys[:, :, :0], values[:, :, :0])  # what attention reads now
    layer.crop(-remove)
    n = max(0, 130 - remove)
    check_counts(layer, n)
    # The kept tokens read back as before the crop: exact where they were exact, their dequantized
    # values where they had been quantized (the error stays, nothing else changes).
    k_now, v_now = layer.update(keys[:, :, :0], values[:, :, :0]) if n else (seen_k[:, :, :0], seen_v[:, :, :0])
    assert torch.allclose(k_now, seen_k[:, :, :n], atol=1e-6) and torch.allclose(v_now, seen_v[:, :, :n], atol=1e-6)
    if n:  # it keeps streaming by the rule
        layer.update(keys[:, :, :40], values[:, :, :40])
        check_counts(layer, n + 40)


def test_crop_rejects_positive_counts(backend_name):
    layer = make_layer(backend_name)
    layer.update(torch.randn(B, H, 4, D), torch.randn(B, H, 4, D))
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)


def test_batch_operations_match_a_cache_built_in_that_order(backend_name):
    keys, values = torch.randn(3, H, 90, D), torch.randn(3, H, 90, D)
    perm = torch.tensor([2, 0, 0])
    a, b = make_layer(backend_name), make_layer(backend_name)
    a.update(keys[:, :, :80], values[:, :, :80])
    a.reorder_cache(perm)
    b.update(keys[perm, :, :80], values[perm, :, :80])
    out_a, out_b = (
        a.update(keys[perm, :, 80:], values[perm, :, 80:]),
        b.update(keys[perm, :, 80:], values[perm, :, 80:]),
    )
    assert torch.equal(out_a[0], out_b[0]) and torch.equal(out_a[1], out_b[1])

    a.batch_select_indices(torch.tensor([1, 2]))
    b.batch_select_indices([1, 2])
    out_a, out_b = a.update(keys[:2, :, :1], values[:2, :, :1]), b.update(keys[:2, :, :1], values[:2, :, :1])
    assert torch.equal(out_a[0], out_b[0])

    c = make_layer(backend_name)
    c.update(keys[:, :, :70], values[:, :, :70])
    c.batch_repeat_interleave(2)
    d = make_layer(backend_name)
    d.update(keys[:, :, :70].repeat_interleave(2, 0), values[:, :, :70].repeat_interleave(2, 0))
    new_k, new_v = keys[:, :, 70:71].repeat_interleave(2, 0), values[:, :, 70:71].repeat_interleave(2, 0)
    assert torch.equal(c.update(new_k, new_v)[1], d.update(new_k, new_v)[1])


def test_reset_forgets_everything(backend_name):
    layer = make_layer(backend_name)
    layer.update(torch.randn(B, H, 70, D), torch.randn(B, H, 70, D))
    layer.reset()
    assert layer.get_seq_length() == 0 and not layer.is_initialized
    k = torch.randn(1, H, 5, 32)  # other batch and head_dim after a reset
    out, _ = layer.update(k, k)
    assert out is k and layer.get_seq_length() == 5


def test_storage_grows_by_amortised_chunks(backend_name):
    layer = make_layer(backend_name, residual_length=16)
    layer.update(torch.randn(1, 1, 16, D), torch.randn(1, 1, 16, D))
    reallocations, last = 0, None
    steps = 1000
    for _ in range(steps):
        layer.update(torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D))
        ptr = layer.values_stream.packed.codes.data.data_ptr()
        reallocations += ptr != last
        last = ptr
    # One reallocation per size class crossed (a quarter of R rows while short, then 32 per doubling), not one per step.
    assert reallocations <= len({size_class(n, 16) for n in range(16, steps + 17)}) < steps / 5
    codes = layer.values_stream.packed.codes
    assert codes.capacity == size_class(len(codes), 16)


def test_a_fifo_moves_its_rows_to_the_front_in_overlapping_pieces_intact():
    # A bounded buffer with less spare room than rows held (the value window: R + R/4 rows for R tokens) moves its
    # live rows back to the front in pieces; random appends and drops must read back as a plain list would.
    rng = random.Random(0)
    buffer, expected, counter = TokenBuffer(1, 2, 3, torch.float32, "cpu", bound=40), [], 0
    for _ in range(400):
        if expected and rng.random() < 0.45:
            n = rng.randint(1, min(len(expected), 9))
            buffer.drop_front(n)
            del expected[:n]
        elif len(expected) < 32:
            n = rng.randint(1, min(8, 40 - len(expected)))
            rows = torch.arange(counter, counter + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3)
            buffer.append(rows)
            expected += range(counter, counter + n)
            counter += n
        assert buffer.capacity <= 40
        assert buffer.view()[0, 1, :, 2].tolist() == expected


def test_size_classes_are_geometric_and_depend_only_on_the_rows():
    for min_rows in (1, 4, 32, 128):
        last = 0
        for needed in [*range(1, 600), 2016, 2017, 8063, 8064, 8065, 10**6 + 1]:
            capacity = size_class(needed, min_rows)
            assert needed <= capacity <= max(min_rows, needed + max(min_rows // 4, needed // CLASSES_PER_DOUBLING))
            assert capacity >= last  # monotone: holding fewer rows never reserves more
            last = capacity


@pytest.mark.parametrize("prompt", [4000, 8064])
def test_the_default_reserves_no_more_packed_bytes_than_the_paper_preset(prompt):
    # The default's exact sinks hold fewer tokens in codes, so its packed buffers, whose capacity is a function of the
    # rows held, never reserve more than the paper preset's, whichever step of a residual cycle.
    layers = {
        preset: KiviLayer(KiviSettings(2, 32, 128, preset=preset), select("reference"))
        for preset in ("default", "paper")
    }
    g = torch.Generator().manual_seed(0)
    for step in range(130):
        k = torch.randn(1, 2, prompt if step == 0 else 1, 64, generator=g)
        reserved = {}
        for preset, layer in layers.items():
            layer.update(k, k)
            streams = (layer.keys_stream, layer.values_stream)
            reserved[preset] = sum(s.packed.allocated_bytes() for s in streams)
        assert reserved["default"] <= reserved["paper"]


@pytest.mark.parametrize("tokens", [4096, 8192, 8192 + 64, 16384])
def test_packed_key_rows_are_not_a_multiple_of_512_bytes_apart(tokens):
    # The fused attention reads all D channel rows of the packed keys at one position together: rows a multiple of
    # 512 bytes apart would share a few L1 sets (storage.ROW_ALIGNMENT_TO_AVOID). The values are token-major: unpadded.
    layer = make_layer("reference", residual_length=128, group_size=32, bits=2)
    k = torch.randn(1, 1, tokens, D)
    layer.update(k, torch.randn(1, 1, tokens, D))
    keys, values = layer.keys_stream.packed, layer.values_stream.packed
    for buffer in (keys.codes, keys.scales, keys.zeros):
        row_bytes = buffer.data.stride(2) * buffer.data.element_size()
        assert row_bytes % 512 != 0 and buffer.capacity * buffer.data.element_size() == row_bytes
    assert values.codes.data.stride(2) == values.codes.width  # token-major rows stay contiguous
    # the spare row room changes nothing stored: the keys read back as the reference quantizer's
    held = keys.num_tokens
    codes, scales, zeros = ref.quantize_keys(k[:, :, :held], 32, 2, keys.scales.dtype)
    expected = ref.dequantize_keys(codes, scales, zeros, held, 32, 2, torch.float32)
    read = layer.keys_stream.codec.unpack(keys, torch.float32)  # (reading codes back is the codec's)
    torch.testing.assert_close(read, expected)


def test_memory_report_for_a_4096_token_llama_cache(backend_name):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    cache = KiviCache(config=config, bits=2, group_size=32, residual_length=128, backend=backend_name, preset="paper")
    head_dim = 64
    for layer_idx in range(2):
        k = torch.randn(1, 2, 4096, head_dim)
        cache.update(k, k, layer_idx)
    report = cache.memory_report()
    elements = 2 * 2 * 4096 * head_dim  # layers x kv heads x tokens x head_dim, for keys (and again values)
    assert report.tokens == 4096
    assert report.dense_bytes == 2 * elements * 4
    quantized = 2 * 2 * (4096 + 4096 - 128) * head_dim  # keys: all 4096 (4096 % 128 == 0); values: all but 128
    assert report.code_bytes == quantized * 2 // 8
    assert report.meta_bytes == quantized // 32 * 2 * 2  # fp16 scale + fp16 zero per group of 32
    assert report.residual_bytes == 2 * 2 * 128 * head_dim * 4
    assert report.compression_ratio == pytest.approx(report.dense_bytes / report.total_bytes)
    assert 9.0 < report.compression_ratio < 9.5  # 3 bits/element + a 128-token fp32 value window
    # The prefill allocates the packed history it needs; beyond that at most the full-precision windows' bounds
    # (R rows for keys, R + R/4 for the value FIFO) are reserved.
    window = 2 * 2 * 128 * head_dim * 4
    assert report.total_bytes <= report.allocated_bytes <= report.total_bytes + 9 * window // 4 - report.residual_bytes
    assert "smaller" in str(report)


def test_memory_follows_the_tokens_held_not_the_residual_length(backend_name):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    cache = KiviCache(config=config, residual_length=2**20, backend=backend_name, preset="paper")
    k = torch.randn(2, 2, 27, 64)
    for layer_idx in range(2):
        cache.update(k, k, layer_idx)
    for layer_idx in range(2):  # a few decode steps: the windows grow with the tokens, not to R rows
        cache.update(k[:, :, :1], k[:, :, :1], layer_idx)
    report = cache.memory_report()
    assert report.tokens == 28 and report.dense_bytes == 2 * 2 * (2 * 2 * 28 * 64 * 4)
    assert report.allocated_bytes <= 4 * report.dense_bytes  # was 2**20 rows per window: 3 GiB
    cache.reorder_cache(torch.tensor([1, 0]))  # beam search copies whole buffers: they must be small too
    assert cache.memory_report().allocated_bytes == report.allocated_bytes
    window = cache.layers[0].keys_stream.window.view()
    torch.testing.assert_close(window, torch.cat([k[[1, 0]], k[[1, 0], :, :1]], dim=2))


@pytest.mark.parametrize(
    "model_dtype, given, stored",
    [
        (torch.bfloat16, None, torch.bfloat16),  # float16 scales would overflow for keys beyond 65504
        (torch.float32, None, torch.float16),
        (torch.float16, None, torch.float16),
        (torch.bfloat16, torch.float16, torch.float16),  # given: kept
        (torch.float32, torch.float32, torch.float32),
    ],
)
def test_metadata_dtype_follows_the_model_unless_given(model_dtype, given, stored):
    layer = KiviLayer(KiviSettings(2, 16, 32, given, preset="paper"), select("reference"))
    states = torch.randn(1, 2, 40, 32, dtype=model_dtype)
    layer.update(states, states)
    assert layer.settings.meta_dtype == stored
    assert layer.keys_stream.packed.scales.data.dtype == layer.values_stream.packed.zeros.data.dtype == stored
    layer.reset()  # resolved again for the next model dtype
    layer.update(states.float(), states.float())
    assert layer.settings.meta_dtype == (torch.float16 if given is None else given)
    assert KiviCache().settings.meta_dtype is None and KiviSettings().bits_per_element() == 3.0


def test_an_absurd_residual_length_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"`residual_length` must be at most 16777216.*got 1099511627776"):
        KiviCache(residual_length=2**40)
    KiviCache(residual_length=2**24, backend="reference")  # the bound itself is accepted


def test_layer_keys_and_values_are_dense_views_computed_on_access(backend_name):
    layer = make_layer(backend_name)  # G=16, R=32
    assert layer.keys is None and layer.values is None
    keys, values = torch.randn(B, H, 70, D), torch.randn(B, H, 70, D)
    layer.update(keys[:, :, :50], values[:, :, :50])
    for t in range(50, 70):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    expected_keys, expected_values = expected_dense(keys, values, 70, layer.settings)
    assert layer.keys.shape == layer.values.shape == (B, H, 70, D) and layer.keys.dtype == torch.float32
    torch.testing.assert_close(layer.keys, expected_keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(layer.values, expected_values, rtol=0, atol=1e-6)
    layer.keys.zero_()  # a new tensor at each access: writing into it changes nothing
    torch.testing.assert_close(layer.keys, expected_keys, rtol=0, atol=1e-6)
    assert "keys" not in vars(layer) and "values" not in vars(layer)  # never kept
    with pytest.raises(AttributeError):
        layer.keys = torch.zeros(1)
    layer.reset()
    assert layer.keys is None


def test_iterating_a_cache_yields_what_dynamic_cache_yields():
    config = Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=16,
    )  # fmt: skip
    cache = KiviCache(config=config, group_size=16, residual_length=32, backend="reference", preset="paper")
    dynamic = DynamicCache(config=config)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer", "KiviLayer"]
    k, v = torch.randn(1, 1, 20, 32), torch.randn(1, 1, 20, 32)
    for c in (cache, dynamic):
        for layer_idx in range(2):
            c.update(k, v, layer_idx)
    got, expected = list(cache), list(dynamic)
    assert len(got) == len(expected) == 2
    for ours, theirs in zip(got, expected, strict=True):
        assert len(ours) == len(theirs) == 3
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])  # inside the window: exact
        assert (ours[2] is None) == (theirs[2] is None) and (ours[2] is None or torch.equal(ours[2], theirs[2]))
    assert got[0][2] is not None and got[1][2] is None  # the sliding layer's window size, none for KIVI
    rebuilt = DynamicCache(ddp_cache_data=cache)  # how DataParallel gathers a cache
    assert rebuilt.get_seq_length(1) == 20 and torch.equal(rebuilt.layers[1].keys, k)


def test_gqa_is_stored_at_kv_heads():
    config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)
    cache = KiviCache(config=config, residual_length=32, backend="reference", preset="paper")
    cache.update(torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32), 0)
    assert cache.layers[0].keys_stream.packed.codes.data.shape[1] == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 3}, "bits"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": -32}, "group_size"),
        ({"group_size": 6}, "group_size"),  # not a multiple of 4 codes per byte at 2 bits
        ({"group_size": 48, "residual_length": 96}, "head_dim"),  # 48 does not divide head_dim 64
        ({"residual_length": 0}, "residual_length"),
        ({"residual_length": 100}, "multiple of `group_size`"),
        ({"meta_dtype": torch.int8}, "meta_dtype"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_constructor_validation(kwargs, match):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=1)
    with pytest.raises(ValueError, match=match):
        KiviCache(config=config, **kwargs)


@pytest.mark.parametrize(
    "keys, values, match",
    [
        ((1, 2, 3, 32), (1, 2, 5, 32), "`key_states` and `value_states` must share batch, kv_heads, tokens"),
        ((1, 2, 3, 32), (2, 2, 3, 32), "must share batch"),
        (
            (2, 3, 32),
            (2, 3, 32),
            r"`key_states` must have rank 4 \[batch, heads, tokens, head_dim\], got shape \(2, 3, 32\)",
        ),
        ((1, 2, 3, 32), (1, 2, 3, 32, 1), r"`value_states` must have rank 4 .* got shape \(1, 2, 3, 32, 1\)"),
    ],
)
def test_update_refuses_states_it_cannot_append(keys, values, match):
    cache = KiviCache(group_size=16, residual_length=32, backend="reference", preset="paper")
    with pytest.raises(ValueError, match=match):
        cache.update(torch.randn(keys), torch.randn(values), 0)
    with pytest.raises(
        TypeError, match=r"`key_states` must have dtype in \(float32, float16, bfloat16\), got torch.int64"
    ):
        cache.update(torch.ones(1, 2, 3, 32, dtype=torch.long), torch.ones(1, 2, 3, 32, dtype=torch.long), 0)


@pytest.mark.parametrize(
    "shape, dtype, what",
    [
        ((2, 2, 1, 32), torch.float32, "got batch 2"),
        ((1, 4, 1, 32), torch.float32, "4 kv heads"),
        ((1, 2, 1, 16), torch.float32, "head_dim 16/16"),
        ((1, 2, 1, 32), torch.float16, "torch.float16 on cpu"),
    ],
)
def test_update_refuses_a_change_of_shape_until_reset(shape, dtype, what):
    cache = KiviCache(group_size=16, residual_length=32, backend="reference", preset="paper")
    cache.update(torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32), 0)
    with pytest.raises(ValueError, match=f"holds states of batch 1, 2 kv heads, head_dim 32/32.*{what}.*reset"):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), 0)
    assert cache.get_seq_length() == 40  # the refused update left nothing behind
    cache.reset()
    cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), 0)
    assert cache.get_seq_length() == 1


def test_wrong_types_for_config_settings_and_backend_are_named():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, vocab_size=8))
    with pytest.raises(TypeError, match="`config` must be a transformers PretrainedConfig.*LlamaForCausalLM: pass"):
        KiviCache(config=model)
    with pytest.raises(TypeError, match="`config` must be a transformers PretrainedConfig or None, got dict"):
        KiviCache(config={"num_hidden_layers": 1})
    with pytest.raises(TypeError, match="`settings` must be a KiviSettings or None, got dict"):
        KiviLayer({"bits": 2})
    with pytest.raises(TypeError, match="`backend` must be a backend name"):
        KiviLayer(None, 3)
    assert KiviLayer(None, "reference").backend.name == "reference"


def test_config_without_attention_fields_is_refused():
    class NotAnLLM:
        def get_text_config(self, decoder=True):
            return self

    with pytest.raises(ValueError, match="num_hidden_layers"):
        KiviCache(config=NotAnLLM())


def test_config_attribute_maps_are_understood():
    cache = KiviCache(config=GPT2Config(n_layer=3, n_head=4, n_embd=128), group_size=32)  # head_dim 32
    assert len(cache.layers) == 3 and all(isinstance(layer, KiviLayer) for layer in cache.layers)
