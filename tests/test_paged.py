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
from kivi_xpu.integration import cache_argument
from kivi_xpu.paged import SUPPORTED_TRANSFORMERS, check_transformers_version, generate_batch, init_continuous_batching
from kivi_xpu.paged import manager as manager_module
from kivi_xpu.paged.cache import PageBudget

pytestmark = pytest.mark.skipif(
    ".".join(transformers.__version__.split(".")[:2]) not in SUPPORTED_TRANSFORMERS,
    reason=f"KIVI pages support transformers {SUPPORTED_TRANSFORMERS}, found {transformers.__version__}",
)
MiB = 2**20
SMALL = dict(group_size=8, residual_length=8)  # the G = 8, R = 8: many flushes in few tokens


def _greedy(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _prompts(lengths, seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def _own_generate(model, prompt, new_tokens, backend=None, **settings) -> list[int]:
    """Greedy tokens of ``model.generate`` with the request's own KiviCache (fused attention)."""
    use_fused_attention(model)
    cache = KiviCache(model.config, backend=backend, **settings)
    out = model.generate(torch.tensor([prompt]), past_key_values=cache, generation_config=_greedy(new_tokens))
    return out[0, len(prompt) :].tolist()


def _chunk_fed_generate(model, prompt, chunk, new_tokens, **settings) -> list[int]:
    """Greedy tokens with a KiviCache whose prompt arrives in chunks of ``chunk`` tokens (chunked prefill), the
    chunks attending through SDPA over the dense states and the decode steps through the fused attention, as the
    paged attention does."""
    cache = KiviCache(model.config, **settings)
    tokens = list(prompt)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        for start in range(0, len(prompt), chunk):
            ids = torch.tensor([prompt[start : start + chunk]])
            positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
            logits = model(ids, **cache_argument(cache), position_ids=positions, use_cache=True).logits
        use_fused_attention(model)
        for _ in range(new_tokens):
            tokens.append(int(logits[0, -1].argmax()))
            positions = torch.tensor([[len(tokens) - 1]])
            logits = model(torch.tensor([[tokens[-1]]]), **cache_argument(cache), position_ids=positions).logits
    return tokens[len(prompt) :]


def _answers(results) -> list[list[int]]:
    return [result.generated_tokens for result in results.values()]


@pytest.fixture
def model():
    return tiny_llama(0)


@pytest.mark.parametrize(
    "dtype, backend, settings",
    [
        (torch.float32, None, SMALL),
        (torch.float32, None, dict(SMALL, preset="paper")),
        (torch.float32, None, dict(SMALL, bits=4, residual_length=16)),
        (torch.float32, "reference", SMALL),
        (torch.bfloat16, None, SMALL),
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


def test_chunked_prefill_equals_a_kivi_cache_fed_the_same_chunks(model):
    prompt, new = _prompts((45,))[0], 20
    config = ContinuousBatchingConfig(max_batch_tokens=16)
    results = generate_batch(model, [prompt], _greedy(new), config, kv_memory=4 * MiB, max_new_tokens=new, **SMALL)
    assert _answers(results)[0] == _chunk_fed_generate(model, prompt, 16, new, **SMALL)


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
    return cache.compute_free_capacity(relative=False), cache.free_slots


def test_finished_and_cancelled_requests_return_pages_and_slots(model):
    manager = init_continuous_batching(model, _greedy(8), kv_memory=4 * MiB, max_requests=3, **SMALL)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        start = _free_state(cache)
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


def test_a_request_longer_than_the_whole_budget_is_refused_and_serving_goes_on(model):
    manager = init_continuous_batching(model, _greedy(4), kv_memory=2 * MiB, max_requests=1, **SMALL)
    limit = manager.budget.max_request_tokens
    manager.start()
    try:
        with pytest.raises(ValueError, match="exceeds the .* tokens"):
            manager.add_request([1] * (limit + 1), max_new_tokens=4)
        request = manager.add_request(_prompts((10,))[0], max_new_tokens=4)
        assert len(_finished(manager, request).generated_tokens) == 4
    finally:
        manager.stop(block=True, timeout=30)


def test_the_budget_bounds_resident_bytes_and_holds_many_times_the_fp32_tokens(model):
    config = model.config
    budget = PageBudget.plan(config, KiviCache(config).settings.for_model_dtype(torch.float32), torch.float32,
                             64 * MiB, max_requests=4)  # fmt: skip
    manager = init_continuous_batching(model, _greedy(2), kv_memory=64 * MiB, max_requests=4)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        assert cache.kv_bytes <= 64 * MiB
        fp32_tokens_per_byte = 1 / (2 * config.num_hidden_layers * config.num_key_value_heads * 32 * 4)
        assert budget.max_request_tokens > 6 * 64 * MiB * fp32_tokens_per_byte
    finally:
        manager.stop(block=True, timeout=30)


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
