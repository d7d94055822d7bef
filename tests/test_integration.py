"""transformers integration: ``cache_implementation="kivi"``, every generate mode, the common architectures.

Tiny random models (fp32, offline). Two kinds of checks:
* with a residual window wider than the whole text KIVI quantizes nothing, so every mode must give exactly what
  ``DynamicCache`` gives: this proves the plumbing (cache creation, beam reordering, batch expansion, crop);
* with a small window the history is quantized many times over; there the fused attention must give the same
  tokens as the dense path, and rollbacks must leave the cache bit-identical to one that never saw the tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from tiny_models import TINY_LLAMA
from transformers import DynamicCache, GenerationConfig, pipeline

from kivi_xpu import KiviCache, KiviLayer, integration
from kivi_xpu.assets import byte_tokenizer

VOCAB = TINY_LLAMA["vocab_size"]
WIDE = {"residual_length": 512, "group_size": 32}  # wider than every text below: nothing is quantized
NARROW = {"residual_length": 16, "group_size": 16}  # a flush every 16 tokens
# The tiny Llama's fields, shared by every architecture below.
COMMON = dict(TINY_LLAMA, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GEMMA_LAYERS = ["sliding_attention", "full_attention"]

# name -> (builder, cache layer types it must get)
ARCHITECTURES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)), ["kivi", "kivi"]),
    "mistral": (
        lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=None)),
        ["kivi", "kivi"],
    ),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)), ["kivi", "kivi"]),
    # Qwen2 with its sliding window on the layers from `max_window_layers` on: full layer 0, sliding layer 1.
    "qwen2-sliding": (
        lambda: transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1)
        ),
        ["kivi", "sliding"],
    ),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=32)), ["kivi", "kivi"]),
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON)), ["kivi", "kivi"]),
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=1024, bos_token_id=1, eos_token_id=2
            )
        ),
        ["kivi", "kivi"],
    ),
    # Gemma-2: attention logit soft-capping + alternating sliding/full layers.
    "gemma2": (
        lambda: transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**COMMON, head_dim=32, sliding_window=16, layer_types=GEMMA_LAYERS)
        ),
        ["sliding", "kivi"],
    ),
    "gemma3": (
        lambda: transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=16, layer_types=GEMMA_LAYERS)
        ),
        ["sliding", "kivi"],
    ),
    # Gemma-4: the last two layers reuse the keys/values of the last sliding and the last full layer.
    "gemma4-shared-kv": (
        lambda: transformers.Gemma4ForCausalLM(
            transformers.Gemma4TextConfig(
                **{**COMMON, "num_hidden_layers": 4},
                head_dim=32,
                global_head_dim=32,
                sliding_window=16,
                layer_types=GEMMA_LAYERS * 2,
                num_kv_shared_layers=2,
            )
        ),
        ["sliding", "kivi", "shared", "shared"],
    ),
}
LAYER_KINDS = {"kivi": KiviLayer, "sliding": transformers.cache_utils.DynamicSlidingWindowLayer}
LAYER_KINDS["shared"] = transformers.cache_utils.DummyLayer


def build(name: str):
    torch.manual_seed(0)
    return ARCHITECTURES[name][0]().eval()


@pytest.fixture(scope="module")
def llama():
    return build("llama")


def prompts(batch=2, length=20, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def greedy(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", 30)
    kwargs.setdefault("min_new_tokens", kwargs["max_new_tokens"])  # random weights: an early EOS would end a run
    return model.generate(**inputs, do_sample=False, **kwargs)


def kivi(**cache_config):
    return {"cache_implementation": "kivi", "cache_config": cache_config}


def fused_and_dense(model, inputs, seed=None, **kwargs):
    """The same ``generate(**kivi(...))`` call with dense KIVI states (``attention="dense"``, under the model's own
    attention) and under the fused KIVI attention (``seed``: the RNG seed each call starts from, for sampling)."""
    dense = dict(kwargs, cache_config={**kwargs["cache_config"], "attention": "dense"})
    runs, original = [], model.config._attn_implementation
    try:
        for attention, arguments in ((original, dense), ("kivi", kwargs)):
            model.set_attn_implementation(attention)
            if seed is not None:
                torch.manual_seed(seed)
            runs.append(model.generate(**inputs, **arguments))
    finally:
        model.config._attn_implementation_internal = original  # (the default, if it was, stays the default)
    return runs


# --- cache_implementation="kivi" itself ---------------------------------------------------------------------


@torch.no_grad()
def test_generate_kwargs_and_generation_config_build_the_configured_cache(llama):
    inputs = prompts(batch=1)
    out = llama.generate(
        **inputs,
        max_new_tokens=5,
        min_new_tokens=5,
        **kivi(bits=4, group_size=16, residual_length=32, meta_dtype="float32"),
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    assert isinstance(cache, KiviCache) and all(isinstance(layer, KiviLayer) for layer in cache.layers)
    assert (cache.settings.bits, cache.settings.group_size, cache.settings.residual_length) == (4, 16, 32)
    assert cache.settings.meta_dtype == torch.float32
    assert cache.get_seq_length() == inputs["input_ids"].shape[1] + 4

    config = GenerationConfig(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, **kivi(bits=4))
    out = llama.generate(**inputs, generation_config=config)
    assert isinstance(out.past_key_values, KiviCache) and out.past_key_values.settings.bits == 4
    assert config.cache_config == {"bits": 4}  # not consumed: the same config serves the next call


@torch.no_grad()
def test_cache_config_takes_every_kivi_cache_option(llama):
    options = dict(
        key_bits=4,
        value_bits=2,
        key_group_size=16,
        value_group_size=32,
        sink_tokens=4,
        residual_length=32,
        layer_overrides=[None, {"value_bits": 4, "meta_dtype": "float32"}],
        attention="dense",
        backend="reference",
    )
    assert set(options) <= set(integration.cache_config_keys())
    out = llama.generate(**prompts(batch=1), max_new_tokens=30, **kivi(**options), return_dict_in_generate=True)
    first, second = (layer.settings for layer in out.past_key_values.layers)
    assert (first.key_bits, first.value_bits, first.key_group_size, first.sink_tokens) == (4, 2, 16, 4)
    assert (second.value_bits, second.meta_dtype) == (4, torch.float32)


@pytest.mark.parametrize(
    ("cache_config", "expected"),
    [
        (None, (4, "hadamard")),
        ({"preset": "paper"}, (0, "none")),
        ({"preset": "paper", "rotation": "hadamard"}, (0, "hadamard")),
    ],
)
def test_cache_config_preset(llama, cache_config, expected):
    kwargs = dict(
        max_new_tokens=3, cache_implementation="kivi", cache_config=cache_config, return_dict_in_generate=True
    )
    out = llama.generate(**prompts(batch=1), **kwargs)
    settings = out.past_key_values.layers[0].settings
    assert (settings.sink_tokens, settings.key_rotation) == expected


def test_a_model_without_full_attention_layers_is_warned_about():
    config = transformers.MistralConfig(**COMMON, sliding_window=64)
    with pytest.warns(UserWarning, match="no layer of this MistralConfig uses full attention"):
        KiviCache(config=config)


def test_generation_config_with_kivi_saves_and_loads(tmp_path):
    config = GenerationConfig(**kivi(bits=2, residual_length=64, meta_dtype="float16"))
    config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.cache_implementation == "kivi"
    assert loaded.cache_config == {"bits": 2, "residual_length": 64, "meta_dtype": "float16"}


@torch.no_grad()
def test_other_cache_implementations_are_left_to_transformers(llama):
    inputs = prompts(batch=1)
    for implementation, expected in (
        (None, DynamicCache),
        ("dynamic", DynamicCache),
        ("static", transformers.StaticCache),
    ):
        out = llama.generate(
            **inputs, max_new_tokens=3, cache_implementation=implementation, return_dict_in_generate=True
        )
        assert type(out.past_key_values) is expected


def test_enable_is_idempotent():
    from transformers.generation import configuration_utils
    from transformers.generation.utils import GenerationMixin

    before = GenerationMixin._prepare_cache_for_generation
    integration.enable()
    integration.enable()
    assert GenerationMixin._prepare_cache_for_generation is before and integration.is_enabled()
    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS.count("kivi") == 1


@pytest.mark.parametrize("version", ["4.57.1", "5.23.0", "5.23.99.post1", "6.0.0", "6.0.0.dev0", "6.0.0rc1", "6.1"])
def test_unsupported_transformers_versions_are_refused(version):
    with pytest.raises(RuntimeError, match=r"supports transformers >=5\.24,<6"):
        integration.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.24.0rc1", "5.24.1.post2", "5.99.0.dev0"])
def test_supported_transformers_versions_and_their_pre_releases_are_accepted(version):
    integration.check_transformers_version(version)


@torch.no_grad()
def test_cache_argument_hands_the_cache_to_forward_without_a_deprecation_warning(llama):
    """The tools call `model(ids, **cache_argument(cache))`: `past_key_values=` warns from transformers 5.24 and
    leaves `forward` in 5.40, inside the range this package supports."""
    cache = KiviCache()
    assert integration.cache_argument(cache) == {"cache": cache}
    ids = prompts(batch=1, length=12)["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        llama(ids, **integration.cache_argument(cache), use_cache=True)
        llama(ids[:, -1:], **integration.cache_argument(cache), use_cache=True)
    assert cache.get_seq_length() == 13


@pytest.mark.parametrize("version", ["not-a-version", "", "5.23-custom build"])
def test_an_unparsable_transformers_version_is_a_clear_error(version):
    with pytest.raises(RuntimeError, match=r"transformers >=5\.24,<6.*not a PEP 440 version"):
        integration.check_transformers_version(version)


# --- architectures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.no_grad()
def test_architecture_generates_like_dynamic_cache_inside_the_window(name):
    model = build(name)
    inputs = prompts()
    dynamic = greedy(model, inputs, cache=DynamicCache(config=model.config))
    out = greedy(model, inputs, **kivi(**WIDE), return_dict_in_generate=True)
    assert torch.equal(out.sequences, dynamic)
    kinds = [next(k for k, cls in LAYER_KINDS.items() if type(layer) is cls) for layer in out.past_key_values.layers]
    assert kinds == ARCHITECTURES[name][1]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.no_grad()
def test_architecture_fused_attention_matches_dense_across_many_flushes(name):
    model = build(name)
    inputs = prompts()
    dense, fused = fused_and_dense(model, inputs, do_sample=False, max_new_tokens=60, **kivi(**NARROW))
    assert torch.equal(dense, fused)
    # The quantization is really there: teacher-forced on the same tokens, the logits move away from exact ones.
    scores = [
        greedy(model, inputs, max_new_tokens=60, output_logits=True, return_dict_in_generate=True, **extra).logits
        for extra in ({}, kivi(**NARROW))
    ]
    assert not torch.allclose(scores[0][-1], scores[1][-1])


def test_a_model_without_a_standard_kv_cache_is_refused():
    model = transformers.RwkvForCausalLM(
        transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, context_length=64)
    )
    with pytest.raises(ValueError, match="cannot serve RwkvForCausalLM: it does not keep a standard key/value cache"):
        model.generate(**prompts(batch=1), max_new_tokens=2, **kivi())


def test_an_encoder_decoder_model_is_refused():
    model = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
        )
    )
    with pytest.raises(ValueError, match="serves decoder-only models; T5ForConditionalGeneration is an encoder"):
        model.generate(**prompts(batch=1), max_new_tokens=2, **kivi())


def test_a_model_with_linear_attention_layers_is_refused():
    config = transformers.LlamaConfig(**COMMON)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="cannot serve layer 1 of type 'linear_attention'"):
        KiviCache(config=config)


# --- generate modes (tiny Llama, GQA) ----------------------------------------------------------------------------


@torch.no_grad()
def test_sampling_and_num_return_sequences_match_dynamic_cache_inside_the_window(llama):
    inputs = prompts()
    kwargs = dict(do_sample=True, top_k=20, max_new_tokens=30, min_new_tokens=30, num_return_sequences=3)
    torch.manual_seed(7)
    dynamic = llama.generate(**inputs, **kwargs)
    torch.manual_seed(7)
    quantized = llama.generate(**inputs, **kwargs, **kivi(**WIDE))
    assert quantized.shape == (6, 50) and torch.equal(quantized, dynamic)


@torch.no_grad()
def test_sampling_fused_matches_dense_across_many_flushes(llama):
    inputs = prompts()
    kwargs = dict(do_sample=True, top_k=20, max_new_tokens=60, num_return_sequences=2, **kivi(**NARROW))
    dense, fused = fused_and_dense(llama, inputs, seed=3, **kwargs)
    assert torch.equal(dense, fused)


@torch.no_grad()
def test_beam_search_with_several_returned_sequences(llama):
    inputs = prompts()
    kwargs = dict(do_sample=False, num_beams=3, num_return_sequences=2, max_new_tokens=30, min_new_tokens=30)
    assert torch.equal(llama.generate(**inputs, **kwargs, **kivi(**WIDE)), llama.generate(**inputs, **kwargs))
    kwargs["max_new_tokens"] = kwargs["min_new_tokens"] = 60
    dense, fused = fused_and_dense(llama, inputs, **kwargs, **kivi(**NARROW))
    assert dense.shape == (4, 80) and torch.equal(dense, fused)


@torch.no_grad()
def test_long_generation_crosses_many_flushes(llama):
    inputs = prompts(batch=1, length=5)
    out = llama.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=300,
        min_new_tokens=300,
        **kivi(**NARROW),
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    assert out.sequences.shape[1] == 305 and cache.get_seq_length() == 304  # the last token is never fed back
    report = cache.memory_report()
    assert report.tokens == 304 and report.compression_ratio > 2.5


@torch.no_grad()
def test_chunked_prefill_appends_chunks_onto_the_history(llama):
    inputs = prompts(batch=1, length=100)
    chunked = greedy(llama, inputs, prefill_chunk_size=32, **kivi(**WIDE))
    assert torch.equal(chunked, greedy(llama, inputs))
    out = greedy(llama, inputs, prefill_chunk_size=32, **kivi(**NARROW), return_dict_in_generate=True)
    assert out.past_key_values.get_seq_length() == 129


def assistant_model():
    torch.manual_seed(5)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    return transformers.LlamaForCausalLM(config).eval()


@torch.no_grad()
def test_assisted_decoding_matches_greedy_inside_the_window(llama):
    inputs = prompts(batch=1)
    out = greedy(llama, inputs, assistant_model=assistant_model(), **kivi(**WIDE), return_dict_in_generate=True)
    assert isinstance(out.past_key_values, KiviCache)
    assert torch.equal(out.sequences, greedy(llama, inputs))


@torch.no_grad()
def test_assisted_decoding_rollbacks_leave_the_cache_as_if_the_rejected_tokens_never_came(llama, monkeypatch):
    """Assisted decoding appends candidate tokens and crops the rejected ones, across many flushes. Replaying only
    the accepted tokens into a fresh cache must give a cache that is bit-identical: same logits for a next token."""
    events: dict[int, list] = {}
    update, crop = KiviLayer.update, KiviLayer.crop

    def recording_update(self, key_states, value_states, *args, **kwargs):
        events.setdefault(id(self), []).append(("update", key_states.clone(), value_states.clone()))
        return update(self, key_states, value_states, *args, **kwargs)

    def recording_crop(self, tokens_to_remove):
        events.setdefault(id(self), []).append(("crop", tokens_to_remove))
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(KiviLayer, "update", recording_update)
    monkeypatch.setattr(KiviLayer, "crop", recording_crop)
    inputs = prompts(batch=1)
    out = greedy(
        llama,
        inputs,
        max_new_tokens=80,
        assistant_model=assistant_model(),
        **kivi(**NARROW),
        return_dict_in_generate=True,
    )
    monkeypatch.undo()
    cache = out.past_key_values
    crops = [e[1] for layer in cache.layers for e in events[id(layer)] if e[0] == "crop"]
    assert any(c < 0 for c in crops), "the assistant never had a candidate rejected: the test proves nothing"

    replay = KiviCache(config=llama.config, **NARROW)
    for layer, fresh in zip(cache.layers, replay.layers, strict=True):
        pending_keys, pending_values = [], []
        for event in events[id(layer)] + [("crop", 0)]:
            if event[0] == "update":
                pending_keys.append(event[1])
                pending_values.append(event[2])
                continue
            if not pending_keys:
                assert event[1] == 0, "a rollback of tokens from before the previous crop: cannot replay"
                continue
            keys, values = torch.cat(pending_keys, dim=2), torch.cat(pending_values, dim=2)
            kept = keys.shape[2] + event[1]
            fresh.update(keys[:, :, :kept], values[:, :, :kept])
            pending_keys, pending_values = [], []
    assert replay.get_seq_length() == cache.get_seq_length() == out.sequences.shape[1] - 1

    next_token = out.sequences[:, -1:]
    position = torch.tensor([[out.sequences.shape[1] - 1]])
    original = llama.config._attn_implementation
    llama.set_attn_implementation("kivi")  # both caches fused (the replay's layers never met the default attention)
    try:
        logits = llama(next_token, position_ids=position, **integration.cache_argument(cache)).logits
        expected = llama(next_token, position_ids=position, **integration.cache_argument(replay)).logits
    finally:
        llama.config._attn_implementation_internal = original
    assert torch.equal(logits, expected)


@torch.no_grad()
def test_left_padded_batch_equals_each_prompt_alone_when_padding_is_whole_windows(llama):
    """KIVI groups tokens by position in the cache; a row padded by a whole number of residual windows (and so of
    groups) is grouped exactly like the same prompt alone (the pads fill groups of their own). The paper preset: with
    sinks, the first cache positions of a padded row hold pads where the prompt alone holds its first tokens."""
    short, long = torch.randint(3, VOCAB, (1, 9)), torch.randint(3, VOCAB, (1, 9 + 32))
    pads = torch.zeros(1, 32, dtype=torch.long)
    batch = {
        "input_ids": torch.cat([torch.cat([pads, short], dim=1), long]),
        "attention_mask": torch.cat([torch.cat([pads, torch.ones_like(short)], dim=1), torch.ones_like(long)]),
    }
    settings = {"residual_length": 32, "group_size": 16, "preset": "paper"}
    together = greedy(llama, batch, max_new_tokens=70, **kivi(**settings))
    for row, ids in enumerate((short, long)):
        alone = greedy(
            llama, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens=70, **kivi(**settings)
        )
        assert torch.equal(together[row, -70:], alone[0, -70:]), f"row {row}"


@torch.no_grad()
def test_left_padded_batch_fused_matches_dense(llama):
    inputs = prompts(batch=3, length=25)
    inputs["attention_mask"][0, :7] = 0
    inputs["attention_mask"][2, :19] = 0
    dense, fused = fused_and_dense(llama, inputs, do_sample=False, max_new_tokens=50, **kivi(**NARROW))
    assert torch.equal(dense, fused)


@torch.no_grad()
def test_a_conversation_continues_in_the_same_cache(llama):
    first = prompts(batch=1, length=12)
    reply = greedy(llama, first, max_new_tokens=20, **kivi(**NARROW), return_dict_in_generate=True)
    cache = reply.past_key_values
    turn = torch.randint(3, VOCAB, (1, 23))  # a multi-token append onto a quantized history

    def continued(sequences, **kwargs):
        ids = torch.cat([sequences, turn], dim=1)
        return ids, greedy(
            llama, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, max_new_tokens=20, **kwargs
        )

    ids, out = continued(reply.sequences, cache=cache)
    assert cache.get_seq_length() == ids.shape[1] + 19
    # The same conversation with a window wider than the text is exactly the full-precision one.
    reply = greedy(llama, first, max_new_tokens=20, **kivi(**WIDE), return_dict_in_generate=True)
    _, wide = continued(reply.sequences, cache=reply.past_key_values)
    _, dynamic = continued(reply.sequences)
    assert torch.equal(wide, dynamic) and out.shape == dynamic.shape


@torch.no_grad()
def test_text_generation_pipeline(llama):
    generator = pipeline("text-generation", model=llama, tokenizer=byte_tokenizer(), device="cpu")
    text = "The cache keeps the newest tokens in full precision."
    kwargs = dict(max_new_tokens=25, do_sample=False, return_full_text=False)
    dynamic = generator(text, **kwargs)[0]["generated_text"]
    assert generator(text, **kwargs, **kivi(**WIDE))[0]["generated_text"] == dynamic
    narrow = generator(text, **kwargs, **kivi(**NARROW))[0]["generated_text"]
    assert isinstance(narrow, str) and narrow


# --- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cache_config, error, match",
    [
        ({"bitz": 2}, ValueError, r"Unknown key\(s\) \['bitz'\] in `cache_config`.*allowed keys: \['bits'"),
        ({"config": None}, ValueError, "the model's config is passed for you"),
        ({"bits": 3}, ValueError, "bits"),
        ({"meta_dtype": "float64"}, ValueError, r"cache_config\['meta_dtype'\]` must be one of"),
        ({"layer_overrides": [None, {"meta_dtype": "fp8"}]}, ValueError, r"\['layer_overrides'\]\[1\]\['meta_dtype'\]"),
        ([("bits", 2)], TypeError, "must be a dict of KiviCache options"),
    ],
)
def test_bad_cache_config_is_refused_with_the_allowed_values(llama, cache_config, error, match):
    with pytest.raises(error, match=match):
        llama.generate(**prompts(batch=1), max_new_tokens=2, cache_implementation="kivi", cache_config=cache_config)


def test_cache_implementation_together_with_a_cache_object_is_refused(llama):
    with pytest.raises(ValueError, match="Passing both cache_implementation='kivi' and a cache object"):
        llama.generate(**prompts(batch=1), max_new_tokens=2, cache_implementation="kivi", cache=KiviCache(llama.config))


@torch.no_grad()
def test_use_cache_false_generates_without_a_cache(llama):
    inputs = prompts(batch=1)
    out = greedy(llama, inputs, max_new_tokens=4, use_cache=False, **kivi())
    assert torch.equal(out, greedy(llama, inputs, max_new_tokens=4))


# --- devices -----------------------------------------------------------------------------------------------------


def test_each_layer_keeps_its_window_on_the_device_of_its_keys():
    """A device_map model feeds each layer on its own device. Only the CPU exists here, so the second layer gets
    `meta` tensors: its full-precision window (and, on the reference path, its packed history) must follow."""
    cache = KiviCache(config=transformers.LlamaConfig(**COMMON), backend="reference", **NARROW)
    for index, device in enumerate(("cpu", "meta")):
        states = torch.randn(1, 2, 40, 32, device=device)
        cache.update(states, states, index)
    for layer, device in zip(cache.layers, ("cpu", "meta"), strict=True):
        for stream in (layer.keys_stream, layer.values_stream):
            assert stream.window.view().device.type == device and stream.packed.device.type == device
