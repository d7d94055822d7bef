"""Continuous batching on KIVI pages (kivi_xpu.paged): exactness against each request's own generate, the pool's
lifecycle (finished and cancelled requests return their pages and slots), budgets, and bad input."""

import time

import pytest
import torch
import transformers
from tiny_models import tiny_llama
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi_xpu import KiviCache, use_fused_attention
from kivi_xpu.backend import select
from kivi_xpu.integration import cache_argument
from kivi_xpu.paged import SUPPORTED_TRANSFORMERS, check_transformers_version, generate_batch, init_continuous_batching
from kivi_xpu.paged import manager as manager_module
from kivi_xpu.paged.budget import RequestTooLong
from kivi_xpu.paged.cache import PageBudget, page_shape

pytestmark = pytest.mark.skipif(
    ".".join(transformers.__version__.split(".")[:2]) not in SUPPORTED_TRANSFORMERS,
    reason=f"KIVI pages support transformers {SUPPORTED_TRANSFORMERS}, found {transformers.__version__}",
)
MiB = 2**20
SMALL = dict(group_size=8, residual_length=8)  # the G = 8, R = 8: many flushes in few tokens
SMALL_MINMAX = dict(SMALL, fit="minmax")  # min-max groups: a last-bit difference of an input seldom moves a code


def _greedy(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _prompts(lengths, seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def _own_generate(model, prompt, new_tokens, backend=None, **settings) -> list[int]:
    """Greedy tokens of ``model.generate`` with the request's own KiviCache (fused attention)."""
    use_fused_attention(model)
    cache = KiviCache(model.config, backend=backend, **settings)
    out = model.generate(torch.tensor([prompt]), cache=cache, generation_config=_greedy(new_tokens))
    return out[0, len(prompt) :].tolist()


def _settings(settings: dict):
    return KiviCache(**settings).settings.for_model_dtype(torch.float32)


def _answers(results) -> list[list[int]]:
    return [result.generated_tokens for result in results.values()]


@pytest.fixture
def model():
    return tiny_llama(0)


def _assert_own_generate_up_to_near_ties(model, prompt, answer, new, bound: float, backend=None, **settings):
    """``answer`` equals the request's own ``generate`` with KiviCache, or differs first where that generate's two best
    logits were within ``bound`` times the largest logit (at least 1) of each other."""
    use_fused_attention(model)
    cache = KiviCache(model.config, backend=backend, **settings)
    out = model.generate(torch.tensor([prompt]), cache=cache, generation_config=_greedy(new), output_scores=True,
                         return_dict_in_generate=True)  # fmt: skip
    own = out.sequences[0, len(prompt) :].tolist()
    if own != answer:
        first = next(i for i, (a, b) in enumerate(zip(own, answer, strict=True)) if a != b)
        scores = out.scores[first][0].float()
        margin = float(scores[own[first]] - scores[answer[first]])
        assert margin <= bound * max(1.0, float(scores.abs().max())), (first, margin)


@pytest.mark.parametrize(
    "dtype, backend, settings",
    [
        (torch.float32, None, SMALL_MINMAX),
        (torch.float32, None, dict(SMALL, preset="paper")),
        (torch.float32, None, dict(SMALL, bits=4, residual_length=16)),
        (torch.float32, "reference", SMALL_MINMAX),
    ],
)
def test_greedy_answers_equal_each_requests_own_generate(model, dtype, backend, settings):
    """Requests of different lengths join and leave mid-flight (2 slots for 5 requests), crossing many flushes."""
    model = model.to(dtype)
    prompts, new = _prompts((5, 23, 40, 3, 17)), 30
    results = generate_batch(model, prompts, _greedy(new), kv_memory=4 * MiB, max_requests=2, backend=backend,
                             max_new_tokens=new, **settings)  # fmt: skip
    for prompt, answer in zip(prompts, _answers(results), strict=True):
        assert answer == _own_generate(model, prompt, new, backend=backend, **settings)


# Per layer (3 layers): 4-bit codes in key groups of 4 (pages of 8 tokens hold two); value groups of 4, float32
# scales and zeros, no rotation; the base.
PER_LAYER = [{"bits": 4, "key_group_size": 4}, {"value_group_size": 4, "meta_dtype": torch.float32, "rotation": "none"},
             None]  # fmt: skip


@pytest.mark.parametrize(
    "backend, settings",
    [
        (None, dict(SMALL_MINMAX, layer_overrides=PER_LAYER)),
        ("reference", dict(SMALL_MINMAX, layer_overrides=PER_LAYER)),
        # key groups of 4 but one layer's of 8: every page holds 8 tokens, two key groups in most layers
        (None, dict(SMALL_MINMAX, group_size=4, layer_overrides=[None, {"key_group_size": 8}, {"value_bits": 4}])),
    ],
)
def test_per_layer_settings_answer_as_each_requests_own_generate(backend, settings):
    """A calibration's per-layer settings: each layer's pages have that layer's bits, groups and metadata (pages of
    different bytes in one block, whole key groups of each layer in every page), and every answer equals its own
    generate with the same ``layer_overrides``."""
    model = tiny_llama(0, num_hidden_layers=3)
    prompts, new = _prompts((5, 23, 40, 3, 17)), 30
    results = generate_batch(model, prompts, _greedy(new), kv_memory=4 * MiB, max_requests=2, backend=backend,
                             max_new_tokens=new, **settings)  # fmt: skip
    for prompt, answer in zip(prompts, _answers(results), strict=True):
        assert answer == _own_generate(model, prompt, new, backend=backend, **settings)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"key_group_size": 16, "residual_length": 16}, r"same residual_length.* \[8, 16\]"),
        ({"sink_tokens": 0}, r"same sink_tokens"),
    ],
)
def test_per_layer_settings_the_pages_cannot_hold_are_refused_by_name(model, override, message):
    with pytest.raises(ValueError, match=message):
        init_continuous_batching(model, kv_memory=4 * MiB, **SMALL, layer_overrides=[override, None])


@pytest.mark.parametrize("backend", [None, "reference"])
def test_least_squares_answers_equal_own_generate_up_to_near_ties(model, backend):
    """With least-squares group fits (the default) a key or value that differs from its own generate's in the last
    bit (it was computed in a batch of other shapes) can move a code, and a code moves its group's refit line: an
    answer may then differ, but only where the own generate's two best logits were within 0.1 % of the largest."""
    prompts, new = _prompts((5, 23, 40, 3, 17)), 30
    results = generate_batch(model, prompts, _greedy(new), kv_memory=4 * MiB, max_requests=2, backend=backend,
                             max_new_tokens=new, **SMALL)  # fmt: skip
    for prompt, answer in zip(prompts, _answers(results), strict=True):
        _assert_own_generate_up_to_near_ties(model, prompt, answer, new, 1e-3, backend, **SMALL)


@pytest.mark.parametrize("max_batch_tokens", [16, None])
def test_bf16_answers_differ_from_own_generate_only_at_near_ties(model, max_batch_tokens):
    """In bf16 the paged kernel's sums (added once per page, not once per chunk) may round an output one bf16 step
    away from the plain kernel's: an answer may then differ, but only where the own generate's two best logits were
    within a few bf16 steps of each other."""
    model = model.to(torch.bfloat16)
    prompts, new = _prompts((5, 23, 40, 3, 17, 150, 97, 230)), 30
    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    results = generate_batch(model, prompts, _greedy(new), config, kv_memory=4 * MiB, max_new_tokens=new, **SMALL)
    for prompt, answer in zip(prompts, _answers(results), strict=True):
        _assert_own_generate_up_to_near_ties(model, prompt, answer, new, 2 * torch.finfo(torch.bfloat16).eps, **SMALL)


@pytest.mark.parametrize("max_batch_tokens", [7, 16, 64, None])
@pytest.mark.parametrize("reuse", [True, False])
def test_split_prompts_answer_as_each_requests_own_generate(model, max_batch_tokens, reuse):
    """However the scheduler splits the prompts (several times the batch's tokens, several requests' chunks in one
    forward, prompts joining while others decode), each answer equals the request's own generate, whose prefill
    attends the exact prompt; with prefix reuse on (the default: the prompts share nothing) and off."""
    prompts, new = _prompts((150, 3, 45, 97, 1, 230)), 24
    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, allow_block_sharing=reuse)
    results = generate_batch(model, prompts, _greedy(new), config, kv_memory=4 * MiB, max_new_tokens=new, **SMALL)
    for prompt, answer in zip(prompts, _answers(results), strict=True):
        assert answer == _own_generate(model, prompt, new, **SMALL)


def test_a_split_prompt_is_stored_as_its_own_kivi_cache_stores_it(model, monkeypatch):
    """After a prompt fed in chunks of 16 the request's pages hold the codes, scales and zeros its own KiviCache holds
    after the same prompt, in every layer."""
    prompt = _prompts((77,))[0]
    config = ContinuousBatchingConfig(max_batch_tokens=16)
    manager = init_continuous_batching(model, _greedy(1), config, kv_memory=4 * MiB, **SMALL)
    seen = {}
    free_blocks = manager_module.KiviPagedCache.free_blocks

    def snapshot_then_free(cache, request_id, no_cache=False):  # the pages just before the request returns them
        blocks = torch.tensor(cache.cache_allocators["full_attention"].block_table[request_id])
        for layer, pages in cache.cache_allocators["full_attention"].pages.items():
            seen[layer] = (pages.keys(blocks), pages.values(blocks))
        free_blocks(cache, request_id, no_cache)

    monkeypatch.setattr(manager_module.KiviPagedCache, "free_blocks", snapshot_then_free)
    manager.start()
    try:
        _finished(manager, manager.add_request(prompt, max_new_tokens=1))
    finally:
        manager.stop(block=True, timeout=30)
    cache = KiviCache(model.config, **SMALL)
    with torch.no_grad():
        model(torch.tensor([prompt]), **cache_argument(cache), use_cache=True)
    for layer, (page_keys, page_values) in seen.items():
        keys, values = cache.layers[layer].keys_stream.held(), cache.layers[layer].values_stream.held()
        groups, per_byte = keys.count // 8, 4  # G = 8 tokens per key group, 2-bit codes
        assert groups and values.count
        for own, paged in zip(keys[1:4], page_keys, strict=True):
            width = groups * (8 // per_byte) if own is keys.codes else groups
            assert torch.equal(own[..., :width], paged[..., :width])
        for own, paged in zip(values[1:4], page_values, strict=True):
            assert torch.equal(own[:, :, : values.count], paged[:, :, : values.count])


def test_each_request_holds_the_split_of_its_length_as_its_own_kivi_cache_holds_it(model, monkeypatch):
    """The counterpart of a stream's one owner of each count: a request's tokens are where the rule's split of its
    length puts them (sinks and window in its slot, the packed ones in its pages), and hold what its own KiviCache,
    run through the same generate, holds there: after a prompt in chunks and decode steps across key blocks."""
    prompts, new = _prompts((77, 30)), 13
    config = ContinuousBatchingConfig(max_batch_tokens=16)
    manager = init_continuous_batching(model, _greedy(new), config, kv_memory=4 * MiB, **SMALL)
    seen = {}
    free_blocks = manager_module.KiviPagedCache.free_blocks

    def snapshot_then_free(cache, request_id, no_cache=False):  # what the request holds just before it returns it
        allocator = cache.cache_allocators["full_attention"]
        blocks, slot = torch.tensor(allocator.block_table[request_id]), cache.holdings.held[request_id].slot
        units = cache.units
        seen[request_id] = {
            layer: (
                pages.keys(blocks),
                pages.values(blocks),
                units.keys[layer][slot].clone(),
                units.values[layer][slot].clone(),
                units.value_base[layer][slot],
            )  # fmt: skip
            for layer, pages in allocator.pages.items()
        }
        free_blocks(cache, request_id, no_cache)

    monkeypatch.setattr(manager_module.KiviPagedCache, "free_blocks", snapshot_then_free)
    manager.start()
    try:
        # One at a time: fp32 linears are not batch-invariant (a decode row's states differ by ~1e-7 in a batch of
        # two), and this compares what is stored bit for bit.
        ids = [manager.add_request(prompt, max_new_tokens=new) for prompt in prompts[:1]]
        answers = [_finished(manager, ids[0]).generated_tokens]
        ids.append(manager.add_request(prompts[1], max_new_tokens=new))
        answers.append(_finished(manager, ids[1]).generated_tokens)
    finally:
        manager.stop(block=True, timeout=30)
    settings = _settings(SMALL)
    for request_id, prompt, answer in zip(ids, prompts, answers, strict=True):
        use_fused_attention(model)
        cache = KiviCache(model.config, **SMALL)
        own = model.generate(torch.tensor([prompt]), cache=cache, generation_config=_greedy(new))
        assert own[0, len(prompt) :].tolist() == answer
        split = settings.split(len(prompt) + new - 1)  # the last token is never fed back
        s, qk, qv = split.sinks, split.packed_keys, split.packed_values
        for layer, (page_keys, page_values, key_rows, value_rows, base) in seen[request_id].items():
            keys, values = cache.layers[layer].keys_stream, cache.layers[layer].values_stream
            assert (keys.length, keys.packed.num_tokens, values.packed.num_tokens) == (split.length, qk, qv)
            # Exact tokens: the same rows, to fp32 rounding (a decode row's states went through paged_decode_attention
            # here and decode_attention there, which sum in other orders).
            close = dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(key_rows[:, :s], keys.sinks.view()[0], **close)
            torch.testing.assert_close(value_rows[:, :s], values.sinks.view()[0], **close)
            torch.testing.assert_close(key_rows[:, s : s + split.key_window], keys.window.view()[0], **close)
            window = s + qv - base  # the slot's first exact value row after the packed ones
            torch.testing.assert_close(value_rows[:, window : window + split.value_window], values.window.view()[0],
                                       **close)  # fmt: skip
            # Packed tokens: the split's counts in the pages, code for code (the rounding above moved no value
            # across a code boundary here).
            for own_part, paged_part in zip(keys.packed.buffers(), page_keys, strict=True):
                assert torch.equal(own_part.view(), paged_part[..., : own_part.view().shape[3]])
            for own_part, paged_part in zip(values.packed.buffers(), page_values, strict=True):
                assert torch.equal(own_part.view(), paged_part[:, :, :qv])


def test_inside_the_window_answers_equal_full_precision_continuous_batching(model):
    prompts, new = _prompts((5, 12, 9)), 10  # every request stays inside its window of 64
    kivi = generate_batch(model, prompts, _greedy(new), kv_memory=4 * MiB, max_new_tokens=new, residual_length=64)
    model.set_attn_implementation("sdpa")
    dense = model.generate_batch(prompts, generation_config=_greedy(new), max_new_tokens=new, warmup=False)
    assert _answers(kivi) == _answers(dense)
    assert model.config._attn_implementation == "sdpa"  # restored after KIVI batching


def _wait_for_cache(manager, timeout=30.0):
    deadline = time.monotonic() + timeout
    while manager.cache is None:
        assert time.monotonic() < deadline, "the generation thread never built its cache"
        time.sleep(0.01)
    return manager.cache


def _finished(manager, request_id, timeout=60.0):
    """The final output of ``request_id`` (other requests' outputs in the shared queue are skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = manager.get_result(timeout=0.5)
        if result is not None and result.request_id == request_id and result.is_finished():
            return result
    raise AssertionError(f"{request_id} did not finish within {timeout} s")


def _free_state(cache):
    return cache.held_bytes, cache.requests_in_flight


def test_finished_and_cancelled_requests_return_pages_and_slots(model):
    manager = init_continuous_batching(model, _greedy(8), kv_memory=4 * MiB, max_requests=3, **SMALL)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        start = _free_state(cache)
        assert start == (0, 0)
        done = manager.add_request(_prompts((30,))[0], max_new_tokens=8)
        long = manager.add_request(_prompts((20,), seed=2)[0], max_new_tokens=500, streaming=True)
        for seen, _output in enumerate(manager.request_id_iter(long)):
            if seen == 3:
                manager.cancel_request(long)
                break
        assert len(_finished(manager, done).generated_tokens) == 8
        deadline = time.monotonic() + 30
        while _free_state(cache) != start:
            assert time.monotonic() < deadline, f"pool did not return to {start}: {_free_state(cache)}"
            time.sleep(0.05)
    finally:
        manager.stop(block=True, timeout=30)


def test_a_prompt_longer_than_the_budget_serves_exactly_is_refused_and_serving_goes_on(model):
    manager = init_continuous_batching(model, _greedy(4), kv_memory=2 * MiB, **SMALL)
    longest = manager.budget.longest_prompt(4, manager.max_batch_tokens)
    assert 0 < longest < 2 * MiB // (2 * 2 * 2 * 32 * 4)  # below the fp32 tokens of the budget: exact states
    manager.start()
    try:
        with pytest.raises(ValueError, match=f"the longest prompt it serves exactly with 4 new tokens is {longest} "):
            manager.add_request([1] * (longest + 1), max_new_tokens=4)
        request = manager.add_request(_prompts((10,))[0], max_new_tokens=4)
        assert len(_finished(manager, request).generated_tokens) == 4
    finally:
        manager.stop(block=True, timeout=30)


def test_generate_batch_refuses_an_input_the_budget_cannot_serve_before_any_work(model, monkeypatch):
    """An input longer than the budget serves raises before any request runs (naming the input and the longest prompt
    served), instead of transformers' empty results beside the fitting requests."""
    manager = init_continuous_batching(model, _greedy(4), kv_memory=2 * MiB, **SMALL)
    longest = manager.budget.longest_prompt(4, manager.max_batch_tokens)
    started = []
    monkeypatch.setattr(manager_module.KiviBatchingManager, "start", lambda self, *a, **k: started.append(1))
    with pytest.raises(RequestTooLong, match=rf"inputs\[1\]: .* the longest prompt it serves exactly with 4 new tokens "
                       rf"is {longest} "):  # fmt: skip
        generate_batch(model, [[1] * 10, [1] * (longest + 1)], _greedy(4), kv_memory=2 * MiB, max_new_tokens=4,
                       **SMALL)  # fmt: skip
    assert not started


def test_an_error_in_the_generation_thread_reaches_the_caller_of_generate_batch(model, monkeypatch):
    """transformers' generation thread only logs what it raises and hands back requests with no tokens; here the
    caller gets the error."""

    def broken(cache, *args, **kwargs):
        raise RuntimeError("a fault in the pages")

    monkeypatch.setattr(manager_module.KiviPagedCache, "update", broken)
    with pytest.raises(RuntimeError, match="generation thread: a fault in the pages") as raised:
        generate_batch(model, _prompts((20, 30)), _greedy(4), kv_memory=2 * MiB, max_new_tokens=4, **SMALL)
    assert str(raised.value.__cause__) == "a fault in the pages"


def test_the_longest_prompt_is_served_exactly_in_chunks(model):
    config = ContinuousBatchingConfig(max_batch_tokens=64)
    manager = init_continuous_batching(model, _greedy(6), config, kv_memory=MiB, **SMALL)
    longest = manager.budget.longest_prompt(6, 64)
    prompt = _prompts((longest,))[0]
    manager.start()
    try:
        answer = _finished(manager, manager.add_request(prompt, max_new_tokens=6)).generated_tokens
    finally:
        manager.stop(block=True, timeout=30)
    assert answer == _own_generate(model, prompt, 6, **SMALL)


def test_admission_reserves_what_a_request_holds_and_never_preempts(model, monkeypatch):
    """Many requests with split prompts in a budget that holds few at once: all answer as their own generate, the
    scheduler's preemption (offload or soft reset) never runs."""
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    def no_preemption(self):
        raise AssertionError("a request was preempted")

    monkeypatch.setattr(OffloadingManager, "offload_requests", no_preemption)
    prompts, new = _prompts((120, 60, 200, 15, 90, 170, 33, 140)), 12
    config = ContinuousBatchingConfig(max_batch_tokens=32)
    kv_memory = 400 * 1024
    budget = PageBudget.plan(page_shape(model.config), _settings(SMALL), torch.float32, kv_memory, None)
    assert budget.requests_held(200, new) < len(prompts)  # they cannot all be in flight at once
    results = generate_batch(model, prompts, _greedy(new), config, kv_memory=kv_memory, max_new_tokens=new, **SMALL)
    for prompt, answer in zip(prompts, _answers(results), strict=True):
        assert answer == _own_generate(model, prompt, new, **SMALL)


def test_a_request_cancelled_mid_prefill_returns_everything_it_held(model):
    config = ContinuousBatchingConfig(max_batch_tokens=8)
    manager = init_continuous_batching(model, _greedy(4), config, kv_memory=4 * MiB, **SMALL)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        request = manager.add_request(_prompts((400,))[0], max_new_tokens=4)
        deadline = time.monotonic() + 30
        while cache.held_bytes == 0:  # admitted: pages, window and staging of the split prompt reserved
            assert time.monotonic() < deadline, "the request was never admitted"
            time.sleep(0.001)
        assert cache.held_bytes >= cache.budget.unit_bytes * (1 + -(-400 // cache.budget.rows))
        manager.cancel_request(request)
        while _free_state(cache) != (0, 0):
            assert time.monotonic() < deadline, f"the cancelled request kept {_free_state(cache)}"
            time.sleep(0.01)
        after = manager.add_request(_prompts((30,))[0], max_new_tokens=4)
        assert len(_finished(manager, after).generated_tokens) == 4
    finally:
        manager.stop(block=True, timeout=30)


def test_the_budget_bounds_resident_bytes_and_holds_many_times_the_fp32_tokens(model):
    config = model.config
    budget = PageBudget.plan(page_shape(config), _settings({}), torch.float32, 64 * MiB, max_requests=None)
    manager = init_continuous_batching(model, _greedy(2), kv_memory=64 * MiB)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        assert cache.kv_bytes <= 64 * MiB
        fp32_tokens = 64 * MiB // (2 * config.num_hidden_layers * config.num_key_value_heads * 32 * 4)
        assert budget.requests_held(3000, 1000) * 4000 > 6 * fp32_tokens
        assert budget.requests_held(400, 100) * 500 >= fp32_tokens  # short requests: no fewer than full precision
    finally:
        manager.stop(block=True, timeout=30)


def test_cpu_offloading_is_refused(model):
    with pytest.raises(ValueError, match="cpu_offload_space"):
        init_continuous_batching(model, None, ContinuousBatchingConfig(cpu_offload_space=1.0), kv_memory=4 * MiB)


def test_transformers_outside_the_supported_range_is_refused(model, monkeypatch):
    with pytest.raises(RuntimeError, match="supports transformers"):
        check_transformers_version("5.99.0")
    check_transformers_version(f"{SUPPORTED_TRANSFORMERS[0]}.3")
    monkeypatch.setattr(manager_module.transformers, "__version__", "4.57.1")  # the module the check reads
    with pytest.raises(RuntimeError, match="found 4.57.1"):
        init_continuous_batching(model, kv_memory=4 * MiB)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_memory=0), "`kv_memory` must be a positive number of bytes"),
        (dict(kv_memory="1G"), "`kv_memory` must be a positive number of bytes"),
        (dict(kv_memory=64 * 1024), "`kv_memory` .* is too small"),
        (dict(kv_memory=4 * MiB, max_requests=0), "`max_requests` must be None or a positive integer"),
        (dict(kv_memory=4 * MiB, bits=3), "bits"),
    ],
)
def test_bad_arguments_are_named(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        init_continuous_batching(model, **kwargs)


def test_several_return_sequences_are_refused(model):
    config = _greedy(4)
    config.num_return_sequences = 2
    config.do_sample = True
    with pytest.raises(ValueError, match="num_return_sequences"):
        init_continuous_batching(model, config, kv_memory=4 * MiB)


def test_the_pages_kernels_follow_the_models_device_as_a_kivi_caches_do(model, monkeypatch):
    """One device rule for KiviCache and KIVI pages (Selection.for_device): the kernels of the model's device, the
    native ones on the CPU and pure PyTorch on a device no compiled kernel reads (here ``meta``, standing in for
    cuda or mps); a backend named for a device its kernels cannot read is refused by name."""
    monkeypatch.delenv("KIVI_XPU_BACKEND", raising=False)  # `auto` (CI names a backend for the whole run)
    on_cpu, _ = manager_module._cache_options(model, 4 * MiB, None, None, {})
    assert on_cpu["backend"] == select().for_device("cpu").name  # native where it was built
    elsewhere = tiny_llama(0).to("meta")
    options, _ = manager_module._cache_options(elsewhere, 4 * MiB, None, None, {})
    assert options["backend"] == "reference"
    with pytest.raises(ValueError, match="runs its kernels on cpu"):
        manager_module._cache_options(elsewhere, 4 * MiB, None, "native", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "past", "length"), [(9, 3, 0, 37), (4, 4, 61, 13), (6, 2, 130, 131)])
def test_chunk_attention_is_the_masked_sdpa(dtype, heads, kv_heads, past, length):
    """The chunk's attention as two flash attentions merged by their log-sum-exp equals SDPA under chunk_mask."""
    from kivi_xpu.paged.attend import chunk_attention, chunk_mask

    torch.manual_seed(past + length)
    rows = torch.randn(1, heads, length, 32, dtype=dtype)
    keys, values = torch.randn(2, 1, kv_heads, past + length, 32, dtype=dtype)
    expected = torch.nn.functional.scaled_dot_product_attention(
        rows.float(), keys.float(), values.float(), attn_mask=chunk_mask(past, length, "cpu"), scale=0.3,
        enable_gqa=True,
    )  # fmt: skip
    got = chunk_attention(rows, keys, values, 0.3)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # bf16 inputs, fp32 reference
    torch.testing.assert_close(got.float(), expected, **tolerance)
