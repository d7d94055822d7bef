"""Fused by default: a KiviCache takes the fused attention unless the user chose an attention implementation.

The cases, each tested below: a model loaded after ``import kivi_xpu`` with no ``attn_implementation`` (through
``from_pretrained``, a constructor, ``pipeline()``), with the cache passed as ``KiviCache(config=...)``,
``KiviCache()`` or ``cache_implementation="kivi"``: fused. ``attn_implementation="sdpa"`` / ``"eager"`` at load,
``set_attn_implementation("sdpa")`` later, or a model loaded before ``import kivi_xpu``: dense. Other caches run
transformers' SDPA exactly as without kivi_xpu.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny_models import tiny_llama
from transformers import AutoModelForCausalLM, DynamicCache, pipeline

from kivi_xpu import KiviCache, KiviLayer, attention
from kivi_xpu.assets import byte_tokenizer
from kivi_xpu.attention import DEFAULT_SDPA

NARROW = {"residual_length": 16, "group_size": 16}  # a flush every 16 tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama().save_pretrained(path)
    return path


def ids(batch=2, length=40):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(1))


def generate(model, cache=None, **kwargs):
    extra = {"cache": cache} if cache is not None else {}
    with torch.no_grad():
        return model.generate(ids(), do_sample=False, max_new_tokens=40, min_new_tokens=40, **extra, **kwargs)


def kivi_layers(model) -> list[KiviLayer]:
    """The KIVI layers of the cache the last generate of ``model`` used (kept by a generate wrapper below)."""
    return [layer for layer in model.last_cache.layers if isinstance(layer, KiviLayer)]


@pytest.fixture(autouse=True)
def keep_last_cache(monkeypatch):
    """Records the cache each forward receives, so that the test can ask its layers which path they took."""
    from transformers import LlamaForCausalLM

    forward = LlamaForCausalLM.forward

    def recording(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            self.last_cache = cache
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", recording)


def dense_reference(model):
    """Tokens of the same generate over the same KIVI settings with dense states (attention="dense")."""
    return generate(model, KiviCache(config=model.config, attention="dense", **NARROW))


@pytest.mark.parametrize(
    "make_cache",
    [
        lambda model: {"cache": KiviCache(config=model.config, **NARROW)},  # the README's first snippet
        lambda model: {"cache": KiviCache(**NARROW)},  # no config: the layers learn the model's at the prefill
        lambda model: {"cache_implementation": "kivi", "cache_config": NARROW},
    ],
    ids=["KiviCache(config)", "KiviCache()", "cache_implementation"],
)
def test_a_model_loaded_without_attn_implementation_takes_the_fused_path(saved, make_cache):
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa" and model.config._attn_implementation is DEFAULT_SDPA
    expected = dense_reference(model)
    kwargs = make_cache(model)
    out = generate(model, kwargs.pop("cache", None), **kwargs)
    assert all(layer.fused for layer in kivi_layers(model))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("chosen", ["sdpa", "eager"])
def test_an_attention_chosen_at_load_gets_the_dense_states(saved, chosen):
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation=chosen).eval()
    assert model.config._attn_implementation is not DEFAULT_SDPA
    generate(model, KiviCache(config=model.config, **NARROW))
    assert not any(layer.fused for layer in kivi_layers(model))


def test_set_attn_implementation_is_a_choice_even_of_the_same_name(saved):
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    generate(model, KiviCache(config=model.config, **NARROW))
    assert not any(layer.fused for layer in kivi_layers(model))
    model.set_attn_implementation("kivi")
    generate(model, KiviCache(config=model.config, **NARROW))
    assert all(layer.fused for layer in kivi_layers(model))


def test_a_model_built_from_a_config_is_fused_by_default_too():
    model = tiny_llama()
    assert model.config._attn_implementation is DEFAULT_SDPA
    generate(model, KiviCache(config=model.config, **NARROW))
    assert all(layer.fused for layer in kivi_layers(model))


def test_the_text_generation_pipeline_takes_the_fused_path(saved):
    generator = pipeline("text-generation", model=str(saved), tokenizer=byte_tokenizer(), device="cpu")
    assert generator.model.config._attn_implementation is DEFAULT_SDPA
    text = "The cache keeps the newest tokens in full precision."
    kwargs = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, return_full_text=False)
    fused = generator(text, **kwargs, cache_implementation="kivi", cache_config=NARROW)[0]["generated_text"]
    assert all(layer.fused for layer in kivi_layers(generator.model))
    generator.model.set_attn_implementation("sdpa")
    dense = generator(text, **kwargs, cache_implementation="kivi", cache_config=NARROW)[0]["generated_text"]
    assert not any(layer.fused for layer in kivi_layers(generator.model))
    assert fused == dense


def test_other_caches_run_transformers_sdpa_unchanged(saved):
    default = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    chosen = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation="sdpa").eval()
    runs = [
        generate(model, DynamicCache(), output_logits=True, return_dict_in_generate=True) for model in (default, chosen)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].logits, runs[1].logits, strict=True):
        assert torch.equal(a, b)


def test_a_layer_whose_attention_bypasses_the_interface_stays_dense():
    """A model whose attention never calls the registered function must get dense states (the tail alone would be
    wrong): the default attention fuses a layer only once the function has seen that layer."""
    model = tiny_llama()
    layer = KiviLayer(model_config=model.config)
    states = torch.randn(1, 2, 40, 32)
    layer.update(states, states)
    keys, _ = layer.update(states[:, :, :1], states[:, :, :1])
    assert not layer.fused and keys.shape[2] == 41


def test_the_log_says_once_which_path_runs(saved, caplog):
    attention._say_once.cache_clear()
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO, logger="kivi_xpu"):
        generate(model, KiviCache(config=model.config, **NARROW))
        generate(model, KiviCache(config=model.config, **NARROW))
    messages = [r.getMessage() for r in caplog.records if "fused KIVI attention" in r.getMessage()]
    assert len(messages) == 1 and "no attn_implementation was chosen" in messages[0]


def test_a_model_loaded_before_kivi_xpu_is_imported_gets_the_dense_states(saved):
    """transformers stores only the resolved name, so a choice made before the import cannot be told from the
    default: such a model keeps SDPA (and the log says how to switch), and still generates correctly."""
    script = textwrap.dedent(
        f"""
        import logging, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(saved)!r}, dtype=torch.float32).eval()
        import kivi_xpu
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        cache = kivi_xpu.KiviCache(config=model.config, residual_length=16, group_size=16)
        ids = torch.randint(3, 256, (1, 40))
        model.generate(ids, cache=cache, do_sample=False, max_new_tokens=30)
        print("fused:", any(layer.fused for layer in cache.layers))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fused: False" in result.stdout
    assert "kivi_xpu.use_fused_attention(model) switches to the fused attention" in result.stderr
