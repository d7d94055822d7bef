"""Continued conversations (kivi_xpu.conversations): a request that extends a kept conversation prefills only its new
tokens and answers as one KiviCache kept across the turns; the store's bound and least-recently-used order."""

import pytest
import torch
from tiny_models import tiny_llama
from transformers import GenerationConfig

from kivi_xpu import KiviCache, use_fused_attention
from kivi_xpu.conversations import Conversations, remember_conversations

SETTINGS = dict(group_size=8, residual_length=8)  # many packed tokens in a short chat


def _greedy(new: int) -> GenerationConfig:
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config.cache_implementation, config.cache_config = "kivi", dict(SETTINGS)
    return config


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_continued_conversation_prefills_only_its_new_tokens_and_answers_as_one_cache_across_turns():
    model = tiny_llama(0)
    use_fused_attention(model)
    conversations = Conversations(64 * 2**20)
    prompt_one = _tokens(40, 1)
    # the reference: one KiviCache across the turns, as a program keeps it
    cache = KiviCache(model.config, **SETTINGS)
    plain = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
    first = model.generate(torch.tensor([prompt_one]), cache=cache, generation_config=plain)
    prompt_two = first[0].tolist() + _tokens(9, 2)
    ids = torch.tensor([prompt_two])  # (with a cache, generate feeds only the tokens after it given their mask)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, generation_config=plain)
    expected = expected[0].tolist()

    remember_conversations(model, conversations)
    fed = []
    forward = model.forward

    def counted(*args, **kwargs):
        fed.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    model.forward = counted
    assert model.generate(torch.tensor([prompt_one]), generation_config=_greedy(12))[0].tolist() == first[0].tolist()
    assert len(conversations) == 1 and fed[0] == 40
    fed.clear()
    got = model.generate(torch.tensor([prompt_two]), generation_config=_greedy(12))[0].tolist()
    assert got == expected
    assert fed[0] == len(prompt_two) - (40 + 12 - 1)  # the answer's last token was never fed: it is new here
    assert len(conversations) == 1  # the continued conversation's cache replaced the one it continued
    # a request that does not begin with a kept conversation starts afresh, and both are kept
    fed.clear()
    model.generate(torch.tensor([_tokens(30, 3)]), generation_config=_greedy(4))
    assert fed[0] == 30 and len(conversations) == 2


def test_the_store_keeps_the_most_recent_within_its_bound_and_hands_each_cache_out_once():
    model = tiny_llama(0)
    caches = []
    for n in (20, 30, 40):
        cache = KiviCache(model.config, **SETTINGS)
        with torch.no_grad():
            model(torch.tensor([_tokens(n, n)]), cache=cache)
        caches.append((tuple(_tokens(n, n)), cache))
    sizes = [cache.memory_report().allocated_bytes for _, cache in caches]
    conversations = Conversations(sizes[0] + sizes[1])
    for tokens, cache in caches[:2]:
        conversations.put(tokens, cache)
    assert conversations.nbytes == sizes[0] + sizes[1]
    conversations.put(*caches[2])  # over the bound: the least recently stored go first
    assert conversations.nbytes <= sizes[0] + sizes[1] and conversations.take(list(caches[0][0]) + [1]) is None
    found = conversations.take(list(caches[2][0]) + [7, 8])
    assert found is not None and found[0] is caches[2][1] and found[1] == 40
    assert conversations.take(list(caches[2][0]) + [7, 8]) is None  # taken: never handed out twice
    assert conversations.take(list(caches[2][0])) is None  # only a shorter kept sequence is continued
    Conversations(0).put(*caches[0])  # a bound of 0 keeps nothing
    with pytest.raises(ValueError, match="`max_bytes` must be a non-negative number of bytes"):
        Conversations(-1)
