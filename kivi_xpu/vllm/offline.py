"""Runs vLLM's CPU engine offline in the vLLM environment (.venv-vllm) and prints what it answered as JSON:
``.venv-vllm/bin/python -m kivi_xpu.vllm.offline SPEC.json``, where the spec names the model, the prompts (token
ids), the new tokens, the engine's options, ``"kivi"`` (``null``: vLLM's own pages) and optionally
``"enforce_eager"`` (default true). Each answer has its tokens and, per step, the greedy choice's margin (the gap
of the top two log-probabilities, which is the logits' gap). tests/test_vllm_plugin.py and
benchmarks/bench_serve_exactness.py --vllm run it from the other environment."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # `make vllm-env`


def run(spec: dict, script: Path | None = None, timeout: float = 3600) -> dict:
    """From any environment: runs this module (or ``script``, which takes the same SPEC.json argument and prints
    one ``RESULT`` line) on ``spec`` in .venv-vllm, the worker's threads on every core and the native kernels (the
    vLLM environment has no SYCL runtime); its RESULT. ``RuntimeError`` with the engine's output if it failed."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make vllm-env` first")
    env = dict(os.environ, KIVI_XPU_BACKEND="native", VLLM_PLUGINS="kivi")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    env.pop("KIVI_XPU_REQUIRE_SYCL", None)
    command = ["-m", "kivi_xpu.vllm.offline"] if script is None else [str(script)]
    with tempfile.TemporaryDirectory() as workdir:
        spec_file = Path(workdir) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        done = subprocess.run([str(VLLM_PYTHON), *command, str(spec_file)], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=workdir)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(spec["engine"])
    if spec["kivi"] is not None:
        engine["additional_config"] = {"kivi": spec["kivi"]}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=spec.get("enforce_eager", True),
              dtype=spec["dtype"], **engine)  # fmt: skip
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, detokenize=False, logprobs=2)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        margins = []
        for step in completion.logprobs:  # the top two log-probabilities' gap: the greedy choice's margin
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        answers.append({"tokens": list(completion.token_ids), "margins": margins})
    engine = llm.llm_engine
    blocks = engine.vllm_config.cache_config.num_gpu_blocks
    print("RESULT " + json.dumps({"answers": answers, "num_blocks": blocks,
                                  "block_size": engine.vllm_config.cache_config.block_size}))  # fmt: skip


if __name__ == "__main__":
    main()
