"""The vLLM plugin's unit ledger (kivi_xpu.vllm.ledger), driven as vLLM's scheduler drives it, without vLLM: units
lent and given back, prompts kept as cached prefixes, and prefix-cache hits cut to what the kept exact states and the
complete pages back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from kivi_xpu.paged.budget import PageShape
from kivi_xpu.vllm.ledger import UnitLedger
from kivi_xpu.vllm.plan import plan
from kivi_xpu.vllm.units import BlockUnits

T, S = 128, 4  # the plan's block tokens and KiviCache's default sinks


class _Pool:
    """vLLM's ``BlockPool`` as the ledger's units use it: blocks with reference counts, block 0 the null block, and
    a free queue whose head vLLM lends pages from; a block leaving the prefix cache is told to the ledger, as the
    plugin's hook on ``_maybe_evict_cached_block`` does."""

    def __init__(self, num_blocks: int):
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0, is_null=i == 0) for i in range(num_blocks)]
        self.blocks[0].ref_cnt = 1
        self.free_block_queue = self  # (the queue's methods are the pool's here)
        self.queue = dict.fromkeys(range(1, num_blocks))  # ordered: lent from the head
        self.ledger = None

    def remove(self, block) -> None:
        del self.queue[block.block_id]

    def append_n(self, blocks) -> None:
        self.queue.update(dict.fromkeys(block.block_id for block in blocks))

    def _maybe_evict_cached_block(self, block) -> None:
        self.ledger.forget_block(block.block_id)

    def lend(self) -> int:
        block = self.blocks[next(iter(self.queue))]
        self.remove(block)
        self._maybe_evict_cached_block(block)
        block.ref_cnt = 1
        return block.block_id


def _ledger(max_requests: int = 4, staging_tokens: int = 1024, prefix_caching: bool = True,
            max_model_len: int = 1024, budget: int = 64 * 2**20) -> UnitLedger:  # fmt: skip
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
    options = {"max_requests": max_requests, "staging_tokens": staging_tokens, "layer_overrides": None}
    planned = plan(options, config, PageShape(2, 32, 2), torch.float32, budget, 256, 256, max_model_len)
    pool = _Pool(planned.num_blocks)
    pool.ledger = UnitLedger(planned, prefix_caching, BlockUnits(pool, planned.unit_blocks))
    return pool.ledger


class _Engine:
    """vLLM's side: requests, their blocks (lent from the pool's free queue, or a hit's), and steps of at most
    ``chunk`` tokens each; before a request's blocks are lent, its units are reserved, as the plugin's hook on
    ``allocate_slots`` does."""

    def __init__(self, ledger: UnitLedger, chunk: int = 256):
        self.ledger, self.chunk, self.blocks, self.pool = ledger, chunk, {}, ledger.units.pool

    def add(self, request_id: str, tokens: list[int], hit_blocks: list[int] = (), hit: int = 0):
        request = SimpleNamespace(request_id=request_id, prompt_token_ids=list(tokens), num_prompt_tokens=len(tokens),
                                  all_token_ids=list(tokens), num_computed_tokens=0)  # fmt: skip
        usable = self.ledger.cap_hit(request, list(hit_blocks), hit) if hit else 0
        request.num_computed_tokens = usable
        self.blocks[request_id] = list(hit_blocks[: usable // T])
        return request, usable

    def step(self, *requests) -> object:
        """One step: each request's next chunk of its prompt, or one answer token."""
        scheduled = []
        for request in requests:
            done = request.num_computed_tokens
            count = min(self.chunk, request.num_prompt_tokens - done) if done < request.num_prompt_tokens else 1
            assert self.ledger.reserve(request, done + count), f"no units free for {request.request_id}"
            if done >= request.num_prompt_tokens:
                request.all_token_ids.append(7)
            request.num_computed_tokens += count
            blocks = self.blocks[request.request_id]
            while len(blocks) * T < request.num_computed_tokens:
                blocks.append(self.pool.lend())
            scheduled.append((request.request_id, request, count))
        return self.ledger.schedule(scheduled, self.blocks.__getitem__)


DOCUMENT = [(i * 7) % 500 + 1 for i in range(700)]


def _stored_document(ledger: UnitLedger, engine: _Engine):
    """The 700-token document's request, its prompt stored in three chunks and kept, then one answer token."""
    request, _ = engine.add("doc", DOCUMENT)
    for _ in range(3):
        engine.step(request)
    engine.step(request)  # the prompt was stored: its staging becomes a cached prefix
    return request


def test_units_come_back_and_a_stored_prompt_is_kept():
    ledger = _ledger()
    engine = _Engine(ledger)
    everything = ledger.free_units
    request, _ = engine.add("doc", DOCUMENT)
    first = engine.step(request)
    assert first.requests["doc"].staging and not first.requests["doc"].keep  # a chunk before the last is staged
    engine.step(request)
    last = engine.step(request).requests["doc"]
    assert last.keep and len(last.staging) == -(-700 // ledger.rows)  # the last chunk is staged too
    engine.step(request)
    assert len(ledger.entries) == 1 and next(iter(ledger.entries.values())).units == list(last.staging)
    ledger.release(["doc"])
    assert ledger.free_units == everything and not ledger.held  # a kept prompt's blocks are free to vLLM


def test_a_hit_is_cut_to_complete_pages_written_after_the_same_tokens():
    ledger = _ledger()
    engine = _Engine(ledger)
    document = _stored_document(ledger, engine)
    blocks = engine.blocks["doc"]
    # 700 tokens stored: keys packed to 640, values to 568, so pages 0-3 are complete.
    assert all(ledger.page_written(blocks[p], DOCUMENT, p) for p in range(4))
    assert not ledger.page_written(blocks[4], DOCUMENT, 4)
    shares = DOCUMENT[:600] + [9] * 100
    _, usable = engine.add("a", shares, blocks[:4], 512)
    assert usable == 512
    # The same 512 tokens but other tokens right after them: page 3 holds those, so it cannot be shared.
    other = DOCUMENT[:512] + [9] * 200
    _, usable = engine.add("b", other, blocks[:4], 512)
    assert usable == 384
    # No kept prompt starts with these tokens: no hit at all.
    _, usable = engine.add("c", [3] * 700, blocks[:4], 512)
    assert usable == 0
    assert next(iter(ledger.entries.values())).pins == 2  # "a" and "b" read it until their prompts are stored
    ledger.release(["a", "b", "c"])  # vLLM aborted them before they ran
    assert next(iter(ledger.entries.values())).pins == 0
    ledger.release([document.request_id])


def test_a_hit_reads_the_cached_prefix_then_copies_it_to_stage_after_it():
    ledger = _ledger(staging_tokens=2048, max_model_len=4096)  # room for the prefix and a copy of it
    engine = _Engine(ledger)
    _stored_document(ledger, engine)
    entry = next(iter(ledger.entries.values()))
    blocks = engine.blocks["doc"]
    short, _ = engine.add("short", DOCUMENT[:600] + [9] * 20, blocks[:4], 512)  # adds too little to be kept
    long, _ = engine.add("long", DOCUMENT[:600] + [9] * 300, blocks[:4], 512)
    step = engine.step(short, long)
    assert step.requests["short"].staging == tuple(entry.units) and step.requests["short"].shared_pages == 4
    # "long" stages a chunk after the prefix: a copy of its rows, since "short" still reads the prefix
    assert step.copies == [(tuple(entry.units), step.requests["long"].staging, 512)]
    assert step.requests["long"].staging != tuple(entry.units) and entry.pins == 1
    engine.step(short, long)
    assert entry.pins == 0  # both prompts are stored (the short one's in the first step)


def test_units_are_vllms_blocks_taken_from_the_top_and_given_back_to_the_tail():
    ledger = _ledger()
    engine, pool = _Engine(ledger), ledger.units.pool
    free_blocks, everything = len(pool.queue), ledger.free_units
    request, _ = engine.add("a", [5] * 300)
    step = engine.step(request)  # its window, and two units of staging for its first chunk
    k, top = ledger.plan.unit_blocks, ledger.units.count - 1
    assert sorted(step.lent) == [top - 2, top - 1, top] and ledger.free_units == everything - 3
    assert len(pool.queue) == free_blocks - 3 * k - 2  # its two pages' blocks too, from the bottom
    ledger.release(["a"])
    assert ledger.free_units == everything
    assert set(list(pool.queue)[-3 * k :]) == {b for u in step.lent for b in range(u * k, u * k + k)}


def test_a_kept_prefix_is_free_blocks_that_units_take_last_and_vllm_may_lend():
    ledger = _ledger(budget=2 * 2**20)  # 170 blocks: 12 units of 14
    engine, pool = _Engine(ledger), ledger.units.pool
    document = _stored_document(ledger, engine)
    window = ledger.held["doc"].slot
    ledger.release([document.request_id])
    (entry,) = ledger.entries.values()
    assert len(entry.units) == 5 and ledger.free_units == ledger.units.count - 1
    tail = set(list(pool.queue)[-6 * 14 :])  # the kept prompt's units, then its window's: lent last
    assert tail == {b for u in [*entry.units, window] for b in range(u * 14, u * 14 + 14)}
    reader, usable = engine.add("reader", DOCUMENT[:600] + [9] * 20, engine.blocks["doc"][:4], 512)
    assert usable == 512 and not set(pool.queue) & {entry.units[0] * 14}  # pinned: out of vLLM's free queue
    ledger.release(["reader"])
    assert entry.units[0] * 14 in pool.queue
    two = [engine.add(f"r{i}", [i + 1] * 900)[0] for i in range(2)]  # 3 units each: window and staging
    engine.step(*two)
    assert ledger.entries  # 6 units came from the 6 that no prefix holds
    engine.step(engine.add("r2", [3] * 900)[0])  # 3 more: from the kept prefix, which is forgotten
    assert not ledger.entries and not ledger.kept
    ledger.release([f"r{i}" for i in range(3)])
    _stored_document(ledger, _Engine(ledger))
    (entry,) = ledger.entries.values()
    while entry.units[0] * 14 not in {pool.lend() for _ in range(14)}:  # vLLM lends its free blocks, the kept last
        pass
    assert not ledger.entries


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_without_prefix_caching_nothing_is_kept_or_hit(prefix_caching):
    ledger = _ledger(prefix_caching=prefix_caching)
    engine = _Engine(ledger)
    _stored_document(ledger, engine)
    assert bool(ledger.entries) == prefix_caching
    _, usable = engine.add("a", DOCUMENT[:600] + [9] * 100, engine.blocks["doc"][:4], 512)
    assert usable == (512 if prefix_caching else 0)


def test_a_hit_without_its_pinned_prefix_is_refused():
    ledger = _ledger()
    engine = _Engine(ledger)
    request, _ = engine.add("stray", DOCUMENT)
    request.num_computed_tokens = 256  # as if vLLM used a hit the ledger never backed
    with pytest.raises(RuntimeError, match="no exact prefix"):
        ledger.schedule([("stray", request, 0)], engine.blocks.__getitem__)


def test_a_freed_request_packs_the_full_pages_of_its_prompt():
    ledger = _ledger()
    engine = _Engine(ledger)
    document = _stored_document(ledger, engine)
    for _ in range(10):
        engine.step(document)
    blocks = engine.blocks["doc"]
    assert not ledger.page_written(blocks[4], document.all_token_ids, 4)  # values of tokens 572-644 in the window
    ledger.release(["doc"])
    (flush,) = engine.step().flushes
    assert (flush.upto, flush.shared_pages, flush.blocks) == (640, 0, tuple(blocks))  # page 4 packed from it
    assert ledger.page_written(blocks[4], document.all_token_ids, 4)
    ledger.forget_block(blocks[4])  # vLLM lends it anew
    assert not ledger.page_written(blocks[4], document.all_token_ids, 4)


def test_pages_holding_answer_tokens_serve_no_hit():
    ledger = _ledger()
    engine = _Engine(ledger)
    document = _stored_document(ledger, engine)
    for _ in range(210):  # 910 tokens: pages 0-5 are complete, page 5 (tokens 644-772) mostly answer tokens
        engine.step(document)
    blocks = engine.blocks["doc"]
    assert ledger.page_written(blocks[4], document.all_token_ids, 4)
    assert not ledger.page_written(blocks[5], document.all_token_ids, 5)
    ledger.release(["doc"])
    assert engine.step().flushes == []


def test_nothing_is_flushed_or_recorded_past_the_exact_prompt():
    ledger = _ledger(staging_tokens=256)  # two units: the exact prompt of 900 ends after its second chunk
    engine = _Engine(ledger)
    early, _ = engine.add("early", [(i * 3) % 500 + 1 for i in range(900)])
    for _ in range(8):
        engine.step(early)
    assert ledger.held["early"].prompt_end == 512
    blocks = engine.blocks["early"]
    assert ledger.page_written(blocks[2], early.all_token_ids, 2)  # tokens 260-388, of the exact 512
    assert not ledger.page_written(blocks[3], early.all_token_ids, 3)
    unstored, _ = engine.add("unstored", [5] * 900)
    engine.step(unstored)  # its first chunk is staged: nothing in its window or pages yet
    ledger.release(["early", "unstored"])
    assert engine.step().flushes == []


def test_a_reset_prefix_cache_forgets_every_kept_prompt_and_page():
    ledger = _ledger()
    engine = _Engine(ledger)
    document = _stored_document(ledger, engine)
    ledger.release([document.request_id])
    everything = ledger.units.count - 1  # (unit 0 holds the null block)
    assert ledger.entries and ledger.page_spill
    ledger.forget()
    assert not ledger.entries and not ledger.page_spill and ledger.free_units == everything
    _, usable = engine.add("a", DOCUMENT[:600] + [9] * 100, engine.blocks["doc"][:4], 512)
    assert usable == 0


def test_a_chat_turn_that_extends_a_kept_prompt_is_kept_in_its_place():
    ledger = _ledger()
    engine = _Engine(ledger)
    first = _stored_document(ledger, engine)
    ledger.release([first.request_id])  # its window packs page 4: five whole blocks serve
    turn = DOCUMENT + [9] * 200
    second, usable = engine.add("second", turn, engine.blocks["doc"][:5], 640)
    assert usable == 640
    step = engine.step(second)  # a chunk before its last: it stages after a copy of the kept prompt's rows
    assert [tokens for *_, tokens in step.copies] == [640]
    assert engine.step(second).requests["second"].keep
    engine.step(second)
    (entry,) = ledger.entries.values()
    assert entry.tokens == turn and len(entry.units) == -(-900 // ledger.rows)
    ledger.release(["second"])
    third, usable = engine.add("third", turn + [8] * 50, engine.blocks["second"][:7], 896)
    assert usable == 896  # the pages the second turn wrote (5 and 6) serve the third


def test_staging_is_reserved_before_prompts_are_kept():
    ledger = _ledger(staging_tokens=512, budget=130 * 12288)  # 4 staging units of 168 tokens; 8 units in all
    engine = _Engine(ledger, chunk=600)
    kept = [engine.add(f"kept-{i}", [i + 1] * 300)[0] for i in range(2)]  # two units each to keep
    staged, _ = engine.add("staged", [9] * 900)  # its first chunk of 600 needs all 4
    engine.step(*kept, staged)
    assert ledger.held["staged"].prompt_end == 900 and len(ledger.held["staged"].staging) == 4
    assert not any(ledger.held[f"kept-{i}"].keep for i in range(2))


def test_the_free_blocks_of_a_hit_are_never_carved_into_units():
    ledger = _ledger()
    k, top = ledger.plan.unit_blocks, ledger.units.count - 1
    request = SimpleNamespace(request_id="r", num_prompt_tokens=100, prompt_token_ids=[1] * 100)
    assert ledger.reserve(request, 100, hit_blocks=[top * k + 3])  # vLLM's cached block, free until it touches it
    assert ledger.reserved["r"] == [top - 1]
    ledger.unreserve("r")


def test_a_reset_takes_back_the_pins_of_waiting_requests():
    ledger = _ledger()
    engine, pool = _Engine(ledger), ledger.units.pool
    document = _stored_document(ledger, engine)
    ledger.release([document.request_id])
    (entry,) = ledger.entries.values()
    engine.add("waiting", DOCUMENT[:600] + [9] * 100, engine.blocks["doc"][:4], 512)
    assert entry.pins == 1 and entry.units[0] * 14 not in pool.queue
    ledger.drop_pins()  # vLLM's reset needs every block but the null one free
    assert entry.pins == 0 and all(u * 14 + b in pool.queue for u in entry.units for b in range(14))


def test_a_request_that_its_pinned_prefix_crowds_out_goes_without_the_hit():
    ledger = _ledger(budget=2 * 2**20)  # 11 units: the kept 700-token prompt takes 5
    engine = _Engine(ledger)
    document = _stored_document(ledger, engine)
    ledger.release([document.request_id])
    engine.step(engine.add("other", [3] * 100)[0])  # a window: 5 units left beside the pinned prefix
    reader, usable = engine.add("reader", DOCUMENT[:600] + [9] * 300, engine.blocks["doc"][:4], 512)
    assert usable == 512
    assert not ledger.reserve(reader, 512 + 256)  # its window and 5 units to stage 768 tokens after a copy
    (entry,) = ledger.entries.values()
    assert entry.pins == 0 and ledger.cap_hit(reader, engine.blocks["doc"][:4], 512) == 0
    reader.num_computed_tokens = 0
    assert ledger.reserve(reader, 256)  # without the hit it fits (the kept prompt's units are free blocks)
