"""The README and docs/ stay true: the README's usage runs, every relative link and anchor resolves, every page of
docs/ is linked from the README, and CI runs the README's test command verbatim."""

import re
import shlex
from pathlib import Path

import pytest
from tiny_models import tiny_llama

import kivi_xpu.assets
from kivi_xpu.assets import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "csrc" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\(([^)\s]+)\)")


def section(text: str, heading: str) -> str:
    """The text under a ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` there is a comment, not a heading)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces as hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", prose(text), flags=re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


def test_anchor_rule_matches_github():
    assert anchors("# Perplexity vs bits per element, without fine-tuning (SmolLM2-135M)\n") == {
        "perplexity-vs-bits-per-element-without-fine-tuning-smollm2-135m"
    }
    assert anchors('## 2. `cache_implementation="kivi"` (`examples/x.py`)\n') == {
        "2-cache_implementationkivi-examplesxpy"
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    text = page.read_text()
    checked = 0
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to missing {target}"
        if anchor:
            assert anchor in anchors(file.read_text()), f"{page.name}: no heading for #{anchor} in {file.name}"
        checked += 1
    if page == README:
        assert checked >= 10


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]) for t in LINK.findall(README.read_text())}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.relative_to(ROOT) in linked, f"README.md does not link {page.relative_to(ROOT)}"


def quick_start_commands() -> dict[str, str]:
    """The README's two commands, by their first word after ``make``: {"demo": "make demo", "test": "make test"}."""
    block = code_blocks(section(README.read_text(), "Quick start"), "bash")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    return {shlex.split(c)[-1]: c for c in commands}


def test_readme_commands_are_makefile_targets():
    commands = quick_start_commands()
    assert set(commands) == {"demo", "test"}
    makefile = (ROOT / "Makefile").read_text()
    for target in commands:
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"Makefile has no target {target}"


def test_ci_runs_the_readme_test_command_last():
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [x for x in lines if x and not x.startswith("#")]
    assert commands[-1] == quick_start_commands()["test"]
    # ... after its own settings, which the test command must not override.
    for setting in ("KIVI_XPU_REQUIRE_SYCL=1", "KIVI_XPU_REQUIRE_NATIVE=1", "KIVI_XPU_BACKEND=sycl"):
        assert f"export {setting}" in commands[:-1]


def test_readme_usage_runs(tmp_path, monkeypatch, capsys):
    """The README's usage, with a tiny random Llama and a byte tokenizer saved where SmolLM2 would be."""
    (code,) = code_blocks(section(README.read_text(), "Usage"), "python")
    tiny_llama().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(kivi_xpu.assets, "smollm2_checkpoint", lambda: tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "readme_usage"})
    out = capsys.readouterr().out
    assert "The history of the Roman Empire" in out
    assert re.search(r"KIVI cache: \d+ tokens, .* smaller", out)
