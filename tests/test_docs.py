"""The README and docs/ stay true: the README's usage runs, its commands parse, its make targets exist, every relative
link and anchor resolves, every `kivi-xpu` flag the docs name exists, the README keeps its word budget, every page
of docs/ is linked from the README, every row of its results table names its source JSON and build, and CI
runs the README's test command verbatim.

Each checker is a function of the text it checks, so that the tests at the end can plant an error and see it found.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from tiny_models import tiny_llama

import kivi_xpu.assets
from kivi_xpu.assets import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "csrc" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```[ \t]*$", flags=re.S | re.M)

# The README's budget (issue 61): what a new user reads in three minutes.
PROSE_WORDS = 1200  # words outside fenced code blocks and tables
FIRST_SCREEN = 60  # lines holding the tagline, the status table, the two commands, the snippet and a picture
PARAGRAPH_WORDS = 70
SNIPPET_LINES = 10


# ---- Markdown --------------------------------------------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The text under a ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` there is a comment, not a heading)."""
    return FENCE.sub("", text)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks and tables (a table line starts with ``|``)."""
    return [line for line in prose(text).splitlines() if not line.lstrip().startswith("|")]


def words(line: str) -> list[str]:
    """The words a reader reads: link targets and HTML comments left out."""
    line = re.sub(r"<!--.*?-->", "", line)
    line = re.sub(r"(!?\[[^\]]*\])\([^)\s]*\)", r"\1", line)
    return re.findall(r"[^\s|#>*\-]\S*", line)


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs: runs of prose lines between blank lines, headings and list items (a list item starts its
    own paragraph; its indented continuation lines belong to it)."""
    found, current = [], []
    for line in prose_lines(text):
        starts_item = re.match(r"\s*([-*+]|\d+\.)\s", line) is not None
        if not line.strip() or line.startswith("#") or starts_item:
            if current:
                found.append(" ".join(current))
            current = [] if not line.strip() or line.startswith("#") else [line]
        else:
            current.append(line)
    if current:
        found.append(" ".join(current))
    return found


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (link targets, code ticks and emphasis dropped) in lower case,
    punctuation other than ``-`` and ``_`` removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets ``-1``, ``-2``, ... as on GitHub."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(text), flags=re.M):
        slug = github_slug(heading)
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


# ---- The checkers ----------------------------------------------------------------------------------------------------


def broken_links(page: Path, text: str) -> list[str]:
    """The relative links of ``text`` (a page at ``page``) whose file is missing or whose ``#anchor`` names no
    heading of that file."""
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve()
        if path and not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (not path or file.suffix == ".md"):
            if anchor not in anchors(file.read_text() if path else text):
                broken.append(f"{target}: no heading for #{anchor} in {file.name if path else page.name}")
    return broken


def budget_breaches(text: str) -> list[str]:
    """Where the README leaves its budget: prose words, the first screen's contents, paragraph length, the
    snippet's length."""
    breaches = []
    prose_words = sum(len(words(line)) for line in prose_lines(text))
    if prose_words > PROSE_WORDS:
        breaches.append(f"{prose_words} words of prose, more than {PROSE_WORDS}")
    for paragraph in paragraphs(text):
        if len(words(paragraph)) > PARAGRAPH_WORDS:
            breaches.append(f"a paragraph of {len(words(paragraph))} words: {paragraph[:80]}...")
    screen = "\n".join(text.splitlines()[:FIRST_SCREEN]) + "\n"
    wanted = {
        "a status table": re.search(r"^\|.*\bstatus\b.*\|$", screen, flags=re.M),
        "the two commands": re.search(r"^make demo\b.*\n^make test\b", screen, flags=re.M),
        "the snippet": code_blocks(screen, "python"),
        "a picture": re.search(r"!\[[^\]]+\]\([^)]+\.(png|svg)\)", screen),
    }
    breaches += [f"the first {FIRST_SCREEN} lines lack {what}" for what, found in wanted.items() if not found]
    for snippet in code_blocks(screen, "python")[:1]:
        if len(snippet.splitlines()) > SNIPPET_LINES:
            breaches.append(f"a snippet of {len(snippet.splitlines())} lines, more than {SNIPPET_LINES}")
    return breaches


def make_targets(text: str) -> set[str]:
    """The targets of every ``make ...`` command in ``text``: a line of a fenced block or a code span that starts
    with ``make``; its words that are neither options nor variable settings."""
    commands = [line for block in FENCE.findall(text) for line in block.splitlines()]
    commands += re.findall(r"`([^`\n]+)`", prose(text))
    targets = set()
    for command in commands:
        if re.match(r"\s*make\s", command):
            for word in shlex.split(command, comments=True)[1:]:
                if "=" not in word and not word.startswith("-"):
                    targets.add(word)
    return targets


def unknown_make_targets(targets: set[str], makefile_dir: Path = ROOT) -> list[str]:
    """The targets ``make -n`` (print, run nothing) refuses in ``makefile_dir``."""
    refused = []
    for target in sorted(targets):
        done = subprocess.run(["make", "-n", target], cwd=makefile_dir, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            refused.append(f"make {target}: {done.stderr.strip()}")
    return refused


KIVI_COMMAND = re.compile(r"(?:kivi-xpu|python -m kivi_xpu(?:\.tools\.(\w+))?) +([a-z][\w-]*)?(.*)")


def kivi_commands(text: str) -> list[tuple[str, list[str]]]:
    """``(subcommand, flags)`` of every ``kivi-xpu <cmd> ...`` (or ``python -m kivi_xpu <cmd>``, ``python -m
    kivi_xpu.tools.<tool>``) in ``text``: in fenced blocks a command runs to the end of its line (``\\``
    continuations joined, a ``#`` comment cut), in prose to the end of its code span."""
    pieces = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            pieces.append(re.split(r"\s#|\||&&|;", line)[0])
    pieces += re.findall(r"`([^`\n]+)`", prose(text))
    found = []
    for piece in pieces:
        for match in KIVI_COMMAND.finditer(piece):
            module, command, rest = match.groups()
            command = {"eval_ppl": "eval-ppl"}.get(module, module) or command
            if command:
                found.append((command, re.findall(r"(?<![\w-])--[a-z0-9][\w-]*", rest)))
    return found


def unknown_kivi_flags(text: str, flags_of: Callable[[str], set[str] | None]) -> list[str]:
    """The ``kivi-xpu`` subcommands and flags named in ``text`` that do not exist (``flags_of(command)``: the
    subcommand's flags, ``None`` for no such subcommand)."""
    unknown = []
    for command, flags in kivi_commands(text):
        known = flags_of(command)
        if known is None:
            unknown.append(f"kivi-xpu {command}: no such subcommand")
            continue
        unknown += [f"kivi-xpu {command} {flag}" for flag in flags if flag not in known]
    return unknown


@cache
def kivi_flags(command: str) -> set[str] | None:
    """The flags of ``kivi-xpu <command>``, read from its parsers (for ``serve`` the KIVI options and transformers
    serve's click options); ``None`` when there is no such subcommand."""
    from kivi_xpu.__main__ import main
    from kivi_xpu.tools import serve

    if command == "serve":
        click_command = serve._transformers_serve_command({}, {})
        return set(serve.parser()._option_string_actions) | {o for p in click_command.params for o in p.opts}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([command, "--help"])  # argparse only: prints the subcommand's usage and exits
        except SystemExit as done:
            if done.code not in (0, None):
                return None
    return set(re.findall(r"(?<![\w-])--[a-z0-9][\w-]*", out.getvalue())) or None


def readme_commands(text: str) -> list[list[str]]:
    """The ``kivi-xpu``, ``python examples/...`` and ``python benchmarks/...`` commands of the README's fenced blocks
    (a launcher such as ``python -m torch.distributed.run`` dropped), as argument lists; a shell substitution (``$X``,
    ``"$(...)"``) becomes the word ``PLACEHOLDER``."""
    commands = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines()[1:-1]:
            try:
                argv = shlex.split(line, comments=True)
            except ValueError:
                continue
            argv = ["PLACEHOLDER" if "$" in word else word for word in argv]
            if argv[:1] == ["kivi-xpu"]:
                commands.append(argv)
            elif argv[:1] == ["python"]:
                scripts = [i for i, w in enumerate(argv) if re.match(r"(examples|benchmarks)/\w+\.py$", w)]
                if scripts:
                    commands.append(argv[scripts[0] :])
    return commands


def unparsed_commands(commands: list[list[str]], cwd: Path = ROOT) -> list[str]:
    """The commands whose arguments do not parse, each parsed without running it by ``parse_only.py`` in one
    process (torch and transformers imported once, a fork per command)."""
    if not commands:
        return []
    run = [sys.executable, str(Path(__file__).with_name("parse_only.py")), json.dumps(commands)]
    done = subprocess.run(run, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# ---- The README and docs/ --------------------------------------------------------------------------------------------


def test_anchor_rule_matches_github():
    assert anchors("# Perplexity vs bits per element, without fine-tuning (SmolLM2-135M)\n") == {
        "perplexity-vs-bits-per-element-without-fine-tuning-smollm2-135m"
    }
    assert anchors('## 2. `cache_implementation="kivi"` (`examples/x.py`)\n') == {
        "2-cache_implementationkivi-examplesxpy"
    }
    assert anchors("## Notes\n## Notes\n## Notes\n") == {"notes", "notes-1", "notes-2"}
    assert anchors("## See [Serving](serving.md)\n") == {"see-serving"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    text = page.read_text()
    assert broken_links(page, text) == []
    if page == README:
        assert len(LINK.findall(prose(text))) >= 10


RESULTS_SECTION = "What you get"  # the README's table of results: each row names its source JSON and build
BUILD = re.compile(r"build `([0-9a-f]{7,40})`")


def unsourced_result_rows(text: str, root: Path = ROOT) -> list[str]:
    """The rows of the README's results table without a link to a committed JSON under ``benchmarks/results/`` or
    without the build it measured (``build `<commit>```, a commit of this repository when git knows it)."""
    rows = [line for line in section(text, RESULTS_SECTION).splitlines() if line.startswith("|")][2:]
    problems = []
    for row in rows:
        sources = [t for t in LINK.findall(row) if t.startswith("benchmarks/results/") and t.endswith(".json")]
        if not sources or not all((root / t).is_file() for t in sources):
            problems.append(f"no committed source JSON: {row[:80]}")
        builds = BUILD.findall(row)
        if not builds:
            problems.append(f"no build: {row[:80]}")
        for build in builds:
            known = subprocess.run(["git", "cat-file", "-e", f"{build}^{{commit}}"], cwd=root, capture_output=True)
            if (root / ".git").exists() and known.returncode != 0:
                problems.append(f"build {build} is not a commit here: {row[:80]}")
    if not rows:
        problems.append("no results table")
    return problems


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]) for t in LINK.findall(README.read_text())}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.relative_to(ROOT) in linked, f"README.md does not link {page.relative_to(ROOT)}"


def test_every_readme_result_row_names_its_source_json_and_build():
    assert unsourced_result_rows(README.read_text()) == []


def test_a_result_row_without_its_source_or_build_is_found():
    readme = README.read_text()
    rows = [line for line in section(readme, RESULTS_SECTION).splitlines() if line.startswith("|")]
    unsourced = readme.replace(rows[2], re.sub(r"\(benchmarks/results/[^)]*\)", "(docs/measurements.md)", rows[2]))
    assert any("no committed source JSON" in p for p in unsourced_result_rows(unsourced))
    unbuilt = readme.replace(rows[2], BUILD.sub("the latest build", rows[2]))
    assert any("no build" in p for p in unsourced_result_rows(unbuilt))
    missing = readme.replace(rows[2], rows[2].replace(".json)", "-missing.json)", 1))
    assert any("no committed source JSON" in p for p in unsourced_result_rows(missing))


def test_the_readme_keeps_its_budget():
    assert budget_breaches(README.read_text()) == []


def test_the_readme_make_targets_exist():
    targets = make_targets(README.read_text())
    assert {"demo", "test"} <= targets
    assert unknown_make_targets(targets) == []


def test_the_readme_commands_parse():
    commands = readme_commands(README.read_text())
    assert any(argv[:2] == ["kivi-xpu", "serve"] for argv in commands)
    assert unparsed_commands(commands) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kivi_xpu_flag_the_docs_name_exists(page):
    assert unknown_kivi_flags(page.read_text(), kivi_flags) == []


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


# ---- The checkers find a planted error ------------------------------------------------------------------------------


def test_a_broken_link_and_a_bad_anchor_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    good = "[ok](other.md) [ok](other.md#a-section) [ok](#here) [web](https://example.com/x)\n\n## Here\n"
    assert broken_links(page, good) == []
    assert len(broken_links(page, good + "[gone](missing.md)\n")) == 1
    assert len(broken_links(page, good + "[bad](other.md#no-such-section)\n")) == 1
    assert len(broken_links(page, good + "![picture](images/none.png)\n")) == 1
    assert broken_links(page, good + "```\n[in code](missing.md)\n```\n") == []  # code is not a link


def test_an_unknown_kivi_xpu_flag_or_subcommand_is_found():
    flags = {"bench": {"--model", "--caches"}, "serve": {"--kv-memory", "--continuous-batching"}}
    good = (
        "Run `kivi-xpu bench --model smollm2 --caches kivi-fused`.\n\n```bash\n"
        "kivi-xpu serve --continuous-batching \\\n    --kv-memory 768   # --not-a-flag in a comment\n```\n"
    )
    assert unknown_kivi_flags(good, flags.get) == []
    assert unknown_kivi_flags(good + "`kivi-xpu bench --no-such-flag`\n", flags.get) == [
        "kivi-xpu bench --no-such-flag"
    ]
    assert unknown_kivi_flags(good + "```\nkivi-xpu serve \\\n  --kv-memry 8\n```\n", flags.get) == [
        "kivi-xpu serve --kv-memry"
    ]
    assert unknown_kivi_flags("`python -m kivi_xpu.tools.bench --cachez x`", flags.get) == ["kivi-xpu bench --cachez"]
    assert unknown_kivi_flags("`kivi-xpu frobnicate --x`", flags.get) == ["kivi-xpu frobnicate: no such subcommand"]


def test_the_real_kivi_xpu_flags_are_read_from_each_subcommand():
    assert {"--caches", "--contexts", "--meta-dtype"} <= kivi_flags("bench")
    assert {"--kv-memory", "--continuous-batching", "--attn-implementation", "--port"} <= kivi_flags("serve")
    assert "--caches" not in kivi_flags("serve") and "--kv-memory" not in kivi_flags("bench")
    assert kivi_flags("no-such-command") is None


def test_a_budget_breach_is_found():
    readme = README.read_text()
    long_paragraph = " ".join(["word"] * (PARAGRAPH_WORDS + 1))
    assert any("a paragraph of" in b for b in budget_breaches(readme.replace("\n## ", f"\n{long_paragraph}\n\n## ", 1)))
    padding = ("filler " * 60 + "\n\n") * (PROSE_WORDS // 60 + 1)
    assert any("words of prose" in b for b in budget_breaches(readme + padding))
    pushed_down = readme.replace("\n## Quick start", "\n" + "\n" * FIRST_SCREEN + "## Quick start", 1)
    assert any("lack the two commands" in b for b in budget_breaches(pushed_down))
    assert any("lack a picture" in b for b in budget_breaches(re.sub(r"!\[[^\]]*\]\([^)]*\)", "", readme)))
    assert budget_breaches("| a | status |\n\nmake demo\nmake test\n\n```python\nx = 1\n```\n![p](p.png)\n") == []


def test_an_unknown_make_target_is_found():
    text = 'Run `make demo ARGS="--bits 4"`, make sure of it, then\n```bash\nmake test  # the tests\n```\n'
    assert make_targets(text) == {"demo", "test"}  # "make sure" is English, not a command
    assert unknown_make_targets({"demo", "test"}) == []
    (refused,) = unknown_make_targets({"demo", "no-such-target"})
    assert refused.startswith("make no-such-target:")


def test_a_command_that_does_not_parse_is_found():
    commands = readme_commands(
        "```bash\npython -m torch.distributed.run --nproc-per-node 2 examples/tensor_parallel.py --tiny\n"
        "kivi-xpu serve --kv-memory 64 \"$(python -c 'print(1)')\"\n```\n"
    )
    assert commands == [
        ["examples/tensor_parallel.py", "--tiny"],
        ["kivi-xpu", "serve", "--kv-memory", "64", "PLACEHOLDER"],
    ]
    bad = [["examples/tensor_parallel.py", "--no-such-flag"], ["kivi-xpu", "serve", "--kv-memory", "lots"]]
    bad += [["kivi-xpu", "serve", "--no-such-flag"], ["kivi-xpu", "bench", "--caches", "nope"]]
    assert len(unparsed_commands(commands + bad)) == len(bad)
