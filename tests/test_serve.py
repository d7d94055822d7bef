"""`kivi-xpu serve`: the real server (a `python -m kivi_xpu serve` subprocess on a loopback port) with a tiny random
Llama saved as a local model directory, asked through the official `openai` client; every answer must equal a
direct greedy `generate` with the same KIVI cache settings, attention and chat template. Plus the errors that stop
the command before it serves."""

import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from kivi_xpu import KiviCache
from kivi_xpu.__main__ import main
from kivi_xpu.tools import serve as serve_tool

try:  # not skipped when missing: `make test` (and CI) installs the serve extra
    import openai
except ImportError as err:
    raise ImportError(f'tests/test_serve.py needs the serve extra: pip install -e ".[serve]" ({err})') from None

ROOT = Path(__file__).resolve().parents[1]
# G=8, R=8: with ~12-token prompts and 24 new tokens, every request flushes into the packed history several times.
KIVI = {"bits": 2, "group_size": 8, "residual_length": 8}
KIVI_FLAGS = ["--bits", "2", "--group-size", "8", "--residual-length", "8"]
MAX_TOKENS = 24
STARTUP_SECONDS = 90
REQUEST_SECONDS = 60
WORDS = [f"w{i}" for i in range(120)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
PROMPTS = [
    "w1 w2 w3 w4 w5 w6",
    "w10 w20 w30 w40",
    "w7 w7 w8 w9 w11 w12 w13 w14",
    "w100 w101",
    " ".join(WORDS[(7 * i) % 120] for i in range(150)),  # long: the batching server feeds it in many chunks
    " ".join(WORDS[(i * i) % 117] for i in range(203)),
]
CB_MAX_BATCH_TOKENS = 16  # the batching server's forward: every prompt but the shortest is split


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (no EOS, so every answer has MAX_TOKENS tokens) with a word-level tokenizer and a chat
    template, saved as a local model directory."""
    path = tmp_path_factory.mktemp("serve") / "tiny-chat"
    vocab = {token: i for i, token in enumerate(["[UNK]", ".", ":", "user", "assistant", "system", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    model = tiny_llama(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=0.1,  # larger weights than the default 0.02: varied answers, which the KIVI cache changes
    )
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[str, str]:
    """prompt -> the direct greedy `generate` of that chat turn with the same KIVI settings and the fused attention,
    decoded as the server decodes. Each must differ from DynamicCache's answer, so that a server that lost the KIVI
    cache fails the test."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kivi").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answers = {}
    for prompt in PROMPTS:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        prompt_length = inputs["input_ids"].shape[1]
        kivi, dense = (
            model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, **cache)[0, prompt_length:]
            for cache in ({"cache_implementation": "kivi", "cache_config": KIVI}, {})
        )
        assert kivi.numel() == MAX_TOKENS
        assert not torch.equal(kivi, dense), prompt
        answers[prompt] = tokenizer.decode(kivi, skip_special_tokens=True)
    assert len(set(answers.values())) == len(PROMPTS)
    return answers


class Server:
    """`python -m kivi_xpu serve` on 127.0.0.1, port 0 (the port it reports from uvicorn's log); its output is
    drained by a thread so that it cannot block, and kept for the failure message."""

    def __init__(self, args: list[str]):
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kivi_xpu", "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._started = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.process.stdout:
            self.lines.append(line)
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                self._started.set()
        self._started.set()  # the process ended

    def wait_started(self, timeout: float) -> str:
        if not self._started.wait(timeout) or self.port is None:
            raise AssertionError(f"the server did not start within {timeout} s:\n{self.log()}")
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=20)


@pytest.fixture(scope="module")
def server(model_dir):
    """(base URL, Server) of a running `kivi-xpu serve` with the test's KIVI settings; stopped afterwards."""
    server = Server(["--device", "cpu", "--dtype", "float32", *KIVI_FLAGS])
    try:
        url = server.wait_started(STARTUP_SECONDS)
        yield url, server
    finally:
        server.stop()


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_SECONDS, max_retries=0)


def chat(url: str, model_dir: Path, prompt: str, stream: bool = False) -> str:
    """One chat turn, greedy, MAX_TOKENS new tokens; the answer's text (the deltas concatenated when streaming)."""
    request = dict(
        model=str(model_dir),
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    if not stream:
        response = client(url).chat.completions.create(**request)
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == MAX_TOKENS
        return response.choices[0].message.content
    parts = []
    for chunk in client(url).chat.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def test_chat_completions_equal_direct_generate(server, model_dir, expected):
    """Non-streaming, streaming and four concurrent requests (queued by the sequential server) all answer exactly
    what `generate` with the same KiviCache settings gives; the request's `model` is the local directory."""
    url, process = server
    deadline = time.monotonic() + 3 * REQUEST_SECONDS
    try:
        assert chat(url, model_dir, PROMPTS[0]) == expected[PROMPTS[0]]
        assert chat(url, model_dir, PROMPTS[1], stream=True) == expected[PROMPTS[1]]
        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: chat(url, model_dir, p, stream=p == PROMPTS[3]), PROMPTS))
        assert answers == [expected[p] for p in PROMPTS]
    except AssertionError as err:
        raise AssertionError(f"{err}\nserver log:\n{process.log()}") from None
    assert time.monotonic() < deadline


def test_a_continued_chat_prefills_only_its_new_turn_and_answers_as_one_cache_across_turns(server, model_dir):
    """The sequential server keeps the recent conversations' caches (--reuse-memory): a chat's second turn, which
    repeats the first turn and its answer, is continued from the first turn's cache (the log says how many prompt
    tokens were reused) and answers as a program that keeps one KiviCache across the turns."""
    url, process = server
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kivi").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first, second = PROMPTS[2], PROMPTS[3]
    cache = KiviCache(model.config, **KIVI)
    turn = tokenizer.apply_chat_template([{"role": "user", "content": first}], add_generation_prompt=True,
                                         return_dict=True, return_tensors="pt")  # fmt: skip
    one = model.generate(**turn, cache=cache, max_new_tokens=MAX_TOKENS, do_sample=False)
    answer = tokenizer.decode(one[0, turn["input_ids"].shape[1] :], skip_special_tokens=True)
    messages = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                {"role": "user", "content": second}]  # fmt: skip
    turn = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    held = cache.get_seq_length()
    assert turn["input_ids"][0, :held].tolist() == one[0, :held].tolist()  # the second turn repeats the first
    two = model.generate(**turn, cache=cache, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = tokenizer.decode(two[0, turn["input_ids"].shape[1] :], skip_special_tokens=True)
    try:
        assert chat(url, model_dir, first) == answer
        response = client(url).chat.completions.create(model=str(model_dir), messages=messages, temperature=0,
                                                       max_tokens=MAX_TOKENS)  # fmt: skip
        assert response.choices[0].message.content == expected
        reused = f"{held} of {turn['input_ids'].shape[1]} prompt tokens reused"
        deadline = time.monotonic() + 10
        while reused not in "".join(process.lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reused in "".join(process.lines)
    except (AssertionError, openai.APIError) as err:
        raise AssertionError(f"{err}\nserver log:\n{process.log()}") from None


def test_server_models_use_kivi(model_dir):
    """The model manager installed by `kivi-xpu serve` gives every model it loads the KIVI cache and the fused
    attention (in-process, without starting a server)."""
    from transformers.cli.serving.model_manager import ModelManager

    manager_class = serve_tool.kivi_model_manager(ModelManager, KIVI)
    manager = manager_class(device="cpu", dtype="float32", attn_implementation="kivi", model_timeout=-1)
    model, _ = manager.load_model_and_processor(manager.process_model_name(str(model_dir)))
    try:
        assert model.device == torch.device("cpu")  # where transformers' --device (the manager's device) says
        assert model.generation_config.cache_implementation == "kivi"
        assert model.generation_config.cache_config == KIVI
        assert model.config._attn_implementation == "kivi"
    finally:
        manager.shutdown()


@pytest.fixture(scope="module")
def batching_server(model_dir):
    """(base URL, Server) of `kivi-xpu serve --continuous-batching` on KIVI pages (16 MiB, 8 requests in flight,
    forwards of 16 query tokens)."""
    server = Server(["--device", "cpu", "--dtype", "float32", *KIVI_FLAGS, "--continuous-batching",
                     "--kv-memory", "16", "--max-requests", "8",
                     "--cb-max-batch-tokens", str(CB_MAX_BATCH_TOKENS)])  # fmt: skip
    try:
        url = server.wait_started(STARTUP_SECONDS)
        yield url, server
    finally:
        server.stop()


def test_continuous_batching_on_kivi_pages_answers_as_direct_generate_under_load(batching_server, model_dir, expected):
    """64 concurrent requests (every other one streaming) through the official client on the continuous-batching
    server: none lost or truncated (8 in flight, the rest queued), and each answer equals `generate` with the same
    KiviCache settings, the long prompts' too, which the server prefills in chunks of 16 tokens."""
    url, process = batching_server
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    try:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            answers = list(pool.map(lambda i: chat(url, model_dir, prompts[i], stream=i % 2 == 1), range(64)))
        assert answers == [expected[p] for p in prompts]
    except AssertionError as err:
        raise AssertionError(f"{err}\nserver log:\n{process.log()}") from None


def test_a_request_longer_than_the_budget_serves_gets_400_and_the_others_are_answered(batching_server, model_dir,
                                                                                      expected):  # fmt: skip
    """A prompt the whole --kv-memory cannot serve exactly gets HTTP 400 naming the longest prompt served (the
    official client's BadRequestError), not a 500; requests beside and after it are answered as `generate`."""
    url, process = batching_server
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            fitting = [pool.submit(chat, url, model_dir, prompt) for prompt in PROMPTS[:2]]
            with pytest.raises(openai.BadRequestError, match="the longest prompt it serves exactly") as refused:
                chat(url, model_dir, "word " * 60_000)
            assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
            assert [f.result() for f in fitting] == [expected[p] for p in PROMPTS[:2]]
        assert chat(url, model_dir, PROMPTS[2]) == expected[PROMPTS[2]]
    except (AssertionError, openai.APIError) as err:
        raise AssertionError(f"{err}\nserver log:\n{process.log()}") from None


def test_a_continued_chat_on_kivi_pages_starts_after_its_history_and_reports_cached_tokens(batching_server,
                                                                                            model_dir):  # fmt: skip
    """On the continuous-batching server a chat's second turn starts after the first turn's prompt (cached exact
    states), answers as its own `generate` with the same KiviCache settings, and its `usage` says how many prompt
    tokens were found cached, streamed or not (0 for the first turn)."""
    url, process = batching_server
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kivi").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = [{"role": "user", "content": " ".join(WORDS[(5 * i) % 113] for i in range(90))}]
    request = dict(model=str(model_dir), temperature=0, max_tokens=MAX_TOKENS)
    try:
        one = client(url).chat.completions.create(messages=first, **request)
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        messages = [*first, {"role": "assistant", "content": one.choices[0].message.content},
                    {"role": "user", "content": PROMPTS[0]}]  # fmt: skip
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                               return_tensors="pt")  # fmt: skip
        own = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, cache_implementation="kivi",
                             cache_config=KIVI)[0, inputs["input_ids"].shape[1] :]  # fmt: skip
        expected = tokenizer.decode(own, skip_special_tokens=True)
        first_prompt = one.usage.prompt_tokens
        for stream in (False, True):
            if not stream:
                two = client(url).chat.completions.create(messages=messages, **request)
                answer, usage = two.choices[0].message.content, two.usage
            else:
                chunks = list(client(url).chat.completions.create(messages=messages, stream=True, **request))
                answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = next(c.usage for c in chunks if c.usage is not None)
            assert answer == expected
            # The first time: after all of turn 1's prompt; the same turn again: after its own whole units.
            least = 1 if stream else first_prompt
            assert least <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    except (AssertionError, openai.APIError) as err:
        raise AssertionError(f"{err}\nserver log:\n{process.log()}") from None


def test_disconnected_streams_give_their_slots_back(batching_server, model_dir, expected):
    """Eight streams (as many as the server's slots) each read one chunk and disconnect; transformers' server cancels
    them, and the eight requests after them are served and answer as `generate` (a leaked slot would leave them
    queued until the client's timeout)."""
    url, process = batching_server
    try:
        for _ in range(2):
            streams = [
                client(url).chat.completions.create(
                    model=str(model_dir),
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0,
                    max_tokens=200,
                    stream=True,
                )  # fmt: skip
                for prompt in PROMPTS * 2
            ]
            for stream in streams:
                next(iter(stream))
                stream.close()
        prompts = PROMPTS * 2
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            answers = list(pool.map(lambda p: chat(url, model_dir, p), prompts))
        assert answers == [expected[p] for p in prompts]
    except (AssertionError, openai.APIError) as err:
        raise AssertionError(f"{err}\nserver log:\n{process.log()}") from None


def test_compile_is_refused(model_dir, capsys):
    assert main(["serve", "--compile", str(model_dir)]) == 2
    assert "--compile is not supported by kivi-xpu serve" in capsys.readouterr().err


@pytest.mark.parametrize("batching", [True, False])
def test_attn_implementation_with_continuous_batching_is_warned_about(batching, model_dir, monkeypatch, caplog):
    """Continuous batching reads the pages with its own attention, so an --attn-implementation given with it is
    ignored, with a warning; without it, the attention is the one asked for and nothing is said. The server is
    stopped where it would start (the model manager installed)."""

    def stop(*_args, **_kwargs):
        raise serve_tool.ToolError("stopped before the server starts")

    monkeypatch.setattr(serve_tool, "_kivi_model_manager_installed", stop)
    args = ["serve", "--attn-implementation", "sdpa", *(["--continuous-batching"] if batching else []), str(model_dir)]
    with caplog.at_level("WARNING", logger="kivi_xpu"):
        assert main(args) == 2
    warned = "--attn-implementation sdpa is ignored with --continuous-batching" in caplog.text
    assert warned == batching


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bits", "3"], "`bits` must be one of (2, 4, 8), got 3"),
        (["--kivi-option", "attention=dense"], "use --attn-implementation"),
        (["--kivi-option", "no_such_option=1"], "no_such_option"),
        (["--meta-dtype", "int8"], "invalid choice: 'int8'"),
        (["--kivi-option", "device=opencl:cpu"], "use --sycl-device"),
        (["--kivi-device", "opencl:cpu"], "No such option: --kivi-device"),  # renamed: now transformers' to refuse
    ],
)
def test_bad_kivi_options(args, message, capsys):
    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_sycl_device_is_the_kivi_filter_and_device_stays_transformers():
    """--sycl-device becomes the cache_config's `device` (KiviCache's SYCL filter); --device and --dtype, the model's,
    are left to transformers serve, whose model manager loads every model with them."""
    args = ["--device", "cpu", "--sycl-device", "opencl:cpu", "--dtype", "float32", "--backend", "reference"]
    options, rest = serve_tool.parser().parse_known_args(args)
    assert options.sycl_device == "opencl:cpu" and rest == ["--device", "cpu", "--dtype", "float32"]
    assert serve_tool.cache_config(options) == {"backend": "reference", "device": "opencl:cpu"}


def test_missing_serving_dependencies(monkeypatch, capsys):
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    assert main(["serve"]) == 2
    assert 'pip install "transformers[serving]"' in capsys.readouterr().err


def test_transformers_options_are_parsed_by_transformers(capsys):
    """A transformers serve option with a bad value is transformers' usage error (exit 2), before any model loads."""
    assert main(["serve", "--port", "not-a-port"]) == 2
    assert "Usage: kivi-xpu serve [OPTIONS] [force_model]" in capsys.readouterr().err
