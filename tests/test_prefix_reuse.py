"""Prefix reuse on KIVI pages (kivi_xpu.paged.prefixes): requests sharing a document or continuing a chat start
from the cached exact states of their prompt's first units, answer as their own generate, store what their own
KiviCache stores; the pool's bytes are always held + cached + free, eviction is LRU, salts separate tenants."""

import random
import time

import pytest
import torch
import transformers
from test_paged import SMALL, MiB, _finished, _greedy, _own_generate, _prompts, _wait_for_cache
from tiny_models import tiny_llama
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kivi_xpu import KiviCache
from kivi_xpu.integration import cache_argument
from kivi_xpu.paged import SUPPORTED_TRANSFORMERS, init_continuous_batching
from kivi_xpu.paged import manager as manager_module
from kivi_xpu.paged.prefixes import PrefixIndex, unit_hashes

pytestmark = pytest.mark.skipif(
    ".".join(transformers.__version__.split(".")[:2]) not in SUPPORTED_TRANSFORMERS,
    reason=f"KIVI pages support transformers {SUPPORTED_TRANSFORMERS}, found {transformers.__version__}",
)


@pytest.fixture
def model():
    return tiny_llama(0)


def _document_prompts(document: int, questions) -> list[list[int]]:
    shared = _prompts((document,), seed=11)[0]
    return [shared + q for q in _prompts(questions, seed=12)]


def _run(manager, prompts, new, salts=None):
    """Submits ``prompts`` at once; returns their answers in order and the cache."""
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        ids = [
            manager.add_request(p, f"r{i}", max_new_tokens=new, cache_salt=None if salts is None else salts[i])
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        return [_finished(manager, request_id).generated_tokens for request_id in ids], cache
    finally:
        manager.stop(block=True, timeout=30)


def _check_accounts(cache):
    """held + cached + free is the pool; every shared page's count is the entries and tables that list it."""
    pool = cache.num_sectors * cache.bytes_per_sector
    assert cache.held_bytes + cache.cached_bytes + cache.free_bytes == pool
    assert cache.held_bytes >= 0 and cache.cached_bytes >= 0
    prefixes = cache.holdings.prefixes
    tables = cache.cache_allocators["full_attention"].block_table
    listed = {}
    for table in tables.values():
        for block in table:
            listed[block] = listed.get(block, 0) + 1
    for entry in prefixes.entries.values():
        for _, block in entry.pages:
            listed[block] = listed.get(block, 0) + 1
    for block, refs in prefixes.page_refs.items():
        assert listed.get(block) == refs, (block, refs, listed.get(block))
    assert all(count == 1 for block, count in listed.items() if block not in prefixes.page_refs)


@pytest.mark.parametrize("max_batch_tokens", [16, None])
def test_requests_sharing_a_document_answer_as_their_own_generate(model, max_batch_tokens):
    """Submitted at once: the first prefills the document, the others wait for its units and start after them."""
    prompts, new = _document_prompts(100, (5, 17, 1, 30, 9)), 16
    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    manager = init_continuous_batching(model, _greedy(new), config, kv_memory=4 * MiB, **SMALL)
    answers, cache = _run(manager, prompts, new)
    rows = cache.budget.rows
    assert cache.holdings.prefixes.cached_tokens == (len(prompts) - 1) * (100 // rows) * rows
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == _own_generate(model, prompt, new, **SMALL)
    _check_accounts(cache)
    assert cache.held_bytes == 0 and cache.cached_bytes > 0
    cache.drop_cached_prefixes()
    assert cache.free_bytes == cache.num_sectors * cache.bytes_per_sector


def test_a_continued_chat_starts_after_the_previous_turns_prompt(model):
    """Turn 2's prompt is turn 1's prompt, its answer and a new question: it starts after turn 1's prompt (its whole
    units and the tail after them), and turn 3 after turn 2's."""
    new = 12
    manager = init_continuous_batching(model, _greedy(new), kv_memory=4 * MiB, **SMALL)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        prompt, turns = _prompts((70,), seed=21)[0], []
        for turn, question in enumerate(_prompts((6, 9), seed=22) + [None]):
            before = cache.holdings.prefixes.cached_tokens
            answer = _finished(manager, manager.add_request(prompt, f"turn{turn}", max_new_tokens=new))
            turns.append((prompt, answer.generated_tokens, cache.holdings.prefixes.cached_tokens - before))
            if question is not None:
                prompt = prompt + answer.generated_tokens + question
    finally:
        manager.stop(block=True, timeout=30)
    assert [cached for _, _, cached in turns] == [0] + [len(p) for p, _, _ in turns[:-1]]
    assert len(turns[0][0]) % cache.budget.rows  # (the first prompt has a tail)
    for prompt, answer, _ in turns:
        assert answer == _own_generate(model, prompt, new, **SMALL)
    _check_accounts(cache)


def test_a_hit_stores_what_its_own_kivi_cache_stores(model, monkeypatch):
    """A request started after a cached document holds, once its prompt is stored, the codes its own KiviCache holds
    after the same prompt: in its shared pages (written by the donor) and its own."""
    prompts = _document_prompts(90, (3, 12))
    config = ContinuousBatchingConfig(max_batch_tokens=16)
    manager = init_continuous_batching(model, _greedy(1), config, kv_memory=4 * MiB, **SMALL)
    seen = {}
    free_blocks = manager_module.KiviPagedCache.free_blocks

    def snapshot_then_free(cache, request_id, no_cache=False):
        held = cache.holdings.held[request_id]
        seen[request_id] = held.shared_pages, {
            layer: (pages.keys(held.blocks), pages.values(held.blocks))
            for layer, pages in cache.cache_allocators["full_attention"].pages.items()
        }  # fmt: skip
        free_blocks(cache, request_id, no_cache)

    monkeypatch.setattr(manager_module.KiviPagedCache, "free_blocks", snapshot_then_free)
    manager.start()
    try:  # one at a time, so that the hit is certain and both prefills run alone
        for i, prompt in enumerate(prompts):
            _finished(manager, manager.add_request(prompt, f"r{i}", max_new_tokens=1))
    finally:
        manager.stop(block=True, timeout=30)
    shared, pages = seen["r1"]
    assert shared > 0
    cache = KiviCache(model.config, **SMALL)
    with torch.no_grad():
        model(torch.tensor([prompts[1]]), **cache_argument(cache), use_cache=True)
    for layer, (page_keys, page_values) in pages.items():
        keys, values = cache.layers[layer].keys_stream.packed, cache.layers[layer].values_stream.packed
        assert keys.num_tokens // 8 > shared and values.num_tokens > shared * 8
        for own, paged in zip(keys.buffers(), page_keys, strict=True):
            assert torch.equal(own.view(), paged[..., : own.view().shape[3]])
        for own, paged in zip(values.buffers(), page_values, strict=True):
            assert torch.equal(own.view(), paged[:, :, : values.num_tokens])


def test_cancelling_a_request_that_holds_shared_pages_keeps_every_count(model):
    """Requests started after a cached document, cancelled mid-prefill and mid-decode, return what they held and
    nothing more: the document stays cached and the next request starts after it, answering as its own generate."""
    prompts = _document_prompts(120, (200, 3, 9))
    config = ContinuousBatchingConfig(max_batch_tokens=8)
    manager = init_continuous_batching(model, _greedy(400), config, kv_memory=4 * MiB, **SMALL)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        _finished(manager, manager.add_request(prompts[0], "donor", max_new_tokens=2))
        entries = len(cache.holdings.prefixes.entries)
        in_prefill = manager.add_request(prompts[0][:120] + prompts[0][121:], "prefill", max_new_tokens=4)
        deadline = time.monotonic() + 30
        while "prefill" not in cache.holdings:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        manager.cancel_request(in_prefill)
        assert cache.cached_prompt_tokens["prefill"] > 0  # it started after the document
        decoding = manager.add_request(prompts[1], "decode", max_new_tokens=400, streaming=True)
        for seen, _output in enumerate(manager.request_id_iter(decoding)):
            if seen == 2:
                assert cache.holdings["decode"].shared_pages > 0
                manager.cancel_request(decoding)
                break
        while cache.requests_in_flight:
            assert time.monotonic() < deadline, "a cancelled request kept what it held"
            time.sleep(0.01)
        _check_accounts(cache)
        assert cache.held_bytes == 0 and len(cache.holdings.prefixes.entries) >= entries
        before = cache.holdings.prefixes.cached_tokens
        answer = _finished(manager, manager.add_request(prompts[2], "after", max_new_tokens=6)).generated_tokens
        assert cache.holdings.prefixes.cached_tokens - before >= 120 // cache.budget.rows * cache.budget.rows
    finally:
        manager.stop(block=True, timeout=30)
    assert answer == _own_generate(model, prompts[2], 6, **SMALL)


def test_requests_of_different_salts_never_share(model):
    prompts, new = _document_prompts(100, (5, 7, 9)), 4
    manager = init_continuous_batching(model, _greedy(new), kv_memory=4 * MiB, **SMALL)
    answers, cache = _run(manager, prompts, new, salts=["tenant a", "tenant b", "tenant a"])
    rows = cache.budget.rows
    assert cache.holdings.prefixes.cached_tokens == 100 // rows * rows  # only the second "tenant a"
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == _own_generate(model, prompt, new, **SMALL)


def test_without_block_sharing_nothing_is_kept(model):
    prompts, new = _document_prompts(100, (5, 7)), 4
    config = ContinuousBatchingConfig(allow_block_sharing=False)
    manager = init_continuous_batching(model, _greedy(new), config, kv_memory=4 * MiB, **SMALL)
    _, cache = _run(manager, prompts, new)
    assert not cache.holdings.prefixes.entries and cache.cached_bytes == 0
    assert cache.free_bytes == cache.num_sectors * cache.bytes_per_sector


def test_a_bad_salt_is_named(model):
    manager = init_continuous_batching(model, _greedy(2), kv_memory=4 * MiB, **SMALL)
    with pytest.raises(ValueError, match="`cache_salt` must be a string"):
        manager.add_request([1, 2, 3], "r", max_new_tokens=2, cache_salt=3)
    with pytest.raises(ValueError, match="needs its `request_id`"):
        manager.add_request([1, 2, 3], max_new_tokens=2, cache_salt="a")


def test_cached_prefixes_make_room_least_recently_used_first(model):
    """In a pool that holds few documents, a new document evicts the least recently used cached one; a document hit
    since stays."""
    new = 2
    manager = init_continuous_batching(model, _greedy(new), kv_memory=MiB, **SMALL)
    documents = [_prompts((150,), seed=30 + i)[0] for i in range(8)]
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        index = cache.holdings.prefixes
        evictions = 0
        for i, document in enumerate(documents):
            _finished(manager, manager.add_request(document + [1], f"d{i}", max_new_tokens=new))
            if i >= 1:  # touch document 0: most recently used from now on
                before = index.cached_tokens
                _finished(manager, manager.add_request(documents[0] + [2], f"t{i}", max_new_tokens=new))
                assert index.cached_tokens > before, "document 0 was evicted although used last"
            rows = cache.budget.rows
            held = {d for d in range(i + 1) if index.match(unit_hashes(documents[d], rows, None, 1))}
            evictions += i + 1 - len(held)
            _check_accounts(cache)
        assert evictions > 0, "the pool never had to evict: make it smaller"
    finally:
        manager.stop(block=True, timeout=30)


def test_a_soak_of_shared_prefixes_and_cancels_keeps_every_count(model):
    """200 requests over 3 documents and a system prompt, a fifth cancelled mid-flight at random; afterwards nothing is
    held, every shared page's count is right, and dropping the cached prefixes frees the whole pool."""
    rng = random.Random(5)
    system = _prompts((40,), seed=40)[0]
    documents = [system + d for d in _prompts((60, 90, 30), seed=41)]
    config = ContinuousBatchingConfig(max_batch_tokens=64)
    manager = init_continuous_batching(model, _greedy(3), config, kv_memory=2 * MiB, **SMALL)
    manager.start()
    try:
        cache = _wait_for_cache(manager)
        pending = []
        for i in range(200):
            prompt = rng.choice(documents) + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
            pending.append(manager.add_request(prompt, f"s{i}", max_new_tokens=3))
            if rng.random() < 0.2:
                manager.cancel_request(pending.pop(rng.randrange(len(pending))))
        deadline = time.monotonic() + 120
        while pending:
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished() and result.request_id in pending:
                pending.remove(result.request_id)
            assert time.monotonic() < deadline, f"{len(pending)} requests never finished"
        while cache.requests_in_flight:  # cancelled ones are freed by the generation thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _check_accounts(cache)
        assert cache.held_bytes == 0 and cache.holdings.prefixes.hit_rate > 0.3
        assert not cache.holdings.prefixes.pending
    finally:
        manager.stop(block=True, timeout=30)
    cache.drop_cached_prefixes()
    assert cache.free_bytes == cache.num_sectors * cache.bytes_per_sector


def test_eviction_takes_leaves_least_recently_used_first():
    index = PrefixIndex()
    a0 = index.register(1, None, 0, unit=10, rows=8)
    a1 = index.register(2, 1, 1, unit=11, rows=8)
    b0 = index.register(3, None, 0, unit=12, rows=8)
    index.release_units([a0, a1, b0])  # all cached; a1 is a leaf, a0 is not
    index.acquire([b0])
    index.release_units([b0])  # b0 used last
    assert [unit for unit, _ in index.evictable()] == [11, 10, 12]  # a0 becomes a leaf once a1 is gone
    assert list(index.evictable()) == []


def test_a_running_requests_units_and_shared_pages_are_never_evicted():
    index = PrefixIndex()
    entry = index.register(1, None, 0, unit=7, rows=8)  # held by the request prefilling it
    index.attach_pages(entry, [(0, 100), (1, 101)])
    assert list(index.evictable()) == []
    index.release_units([entry])  # its prompt is stored: cached, its pages still listed by the request
    [(unit, freed)] = index.evictable()
    assert unit == 7 and freed == []  # the pages stay with the request
    assert index.release_pages([100, 101]) == [100, 101]


def test_a_decode_key_block_straddling_shared_pages_is_packed_into_its_private_pages():
    """A key block leaves the window R tokens at a time; when its first pages are a cached prefix's, the rest must
    still be packed (into the request's own pages), and only the rest."""
    from kivi_xpu.paged.store import DecodePlan, Request, WritablePages

    settings = KiviCache(group_size=8, residual_length=32).settings.for_model_dtype(torch.float32)
    n = next(n for n in range(40, 400) if settings.split(n + 1).packed_keys > settings.split(n).packed_keys)
    qk0, qk1 = settings.split(n).packed_keys, settings.split(n + 1).packed_keys
    shared = qk0 // 8 + 1  # the block's first page is shared, its others are not

    class Units:
        @staticmethod
        def value_base_for(split):
            return split.packed_values - split.packed_values % 8

    request = Request("r", 0, n, 0, 1, torch.arange(100), 0, None, settings.split(n), shared, False)
    plan = DecodePlan.of([request], settings, 8, Units(), "cpu")
    assert [(r.request_id, start, count) for r, start, count in plan.key_blocks] == [("r", qk0, qk1 - qk0)]
    start, rest = WritablePages(request.blocks, shared * 8).writable_part(qk0, torch.zeros(1, 1, qk1 - qk0, 4))
    assert start == shared * 8 and rest.shape[2] == qk1 - shared * 8
