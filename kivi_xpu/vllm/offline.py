"""Runs vLLM's CPU engine offline in the vLLM environment (.venv-vllm) and prints what it answered as JSON:
``.venv-vllm/bin/python -m kivi_xpu.vllm.offline SPEC.json``, where the spec names the model, the prompts (token
ids), the new tokens, the engine's options, ``"kivi"`` (``null``: vLLM's own pages) and optionally
``"enforce_eager"`` (default true) and ``"then"`` (prompts sent once the first have been answered). Each answer has
its tokens, per step the greedy choice's margin (the gap of the top two log-probabilities, which is the logits'
gap), and the prompt tokens that vLLM's prefix cache held (``"cached"``). tests/test_vllm_plugin.py and
benchmarks/bench_serve_exactness.py --vllm run it from the other environment."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # `make vllm-env`


def engine_env(ranks: int) -> dict:
    """The environment of a vLLM process of .venv-vllm with the plugin: the native kernels (the vLLM environment has
    no SYCL runtime) and the workers' threads on every core, split between ``ranks`` (unless the caller's environment
    binds them)."""
    env = dict(os.environ, KIVI_XPU_BACKEND="native", VLLM_PLUGINS="kivi")
    share = max(1, os.cpu_count() // ranks)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(f"{r * share}-{r * share + share - 1}" for r in range(ranks)))
    env.pop("KIVI_XPU_REQUIRE_SYCL", None)
    return env


def run(spec: dict, script: Path | None = None, timeout: float = 3600) -> dict:
    """From any environment: runs this module (or ``script``, which takes the same SPEC.json argument and prints
    one ``RESULT`` line) on ``spec`` in .venv-vllm (:func:`engine_env`, ``tensor_parallel_size`` ranks); its RESULT.
    ``RuntimeError`` with the engine's output if it failed."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make vllm-env` first")
    env = engine_env(spec["engine"].get("tensor_parallel_size", 1))
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


def margins(logprobs) -> list[float]:
    """Per step of a completion's ``logprobs`` (each the top log-probabilities by token): the gap of the top two, the
    greedy choice's margin."""
    result = []
    for step in logprobs:
        top = sorted((lp.logprob for lp in step.values()), reverse=True)
        result.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return result


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(spec["engine"])
    if spec["kivi"] is not None:
        engine["additional_config"] = {"kivi": spec["kivi"]}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=spec.get("enforce_eager", True),
              dtype=spec["dtype"], **engine)  # fmt: skip
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, detokenize=False, logprobs=2,
                            ignore_eos=True)  # fmt: skip
    outputs = []
    for prompts in (spec["prompts"], spec.get("then", [])):
        outputs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    answers = [{"tokens": list(o.outputs[0].token_ids), "margins": margins(o.outputs[0].logprobs),
                "cached": o.num_cached_tokens or 0} for o in outputs]  # fmt: skip
    cache_config = llm.llm_engine.vllm_config.cache_config
    result = {"answers": answers, "num_blocks": cache_config.num_gpu_blocks, "block_size": cache_config.block_size}
    if spec["kivi"] is not None:  # one rank's bytes (the plan of this process's config: every rank's is the same)
        from . import state

        plan = state.plan_of(llm.llm_engine.vllm_config)
        result["block_bytes"], result["unit_bytes"] = plan.page_bytes * plan.shape.num_layers, plan.unit_bytes
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
