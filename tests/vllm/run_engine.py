"""Runs vLLM's CPU engine offline in the vLLM environment (.venv-vllm) and prints what it answered as JSON:
``python tests/vllm/run_engine.py SPEC.json`` where the spec names the model, the prompts (token ids), the new tokens,
the engine's options and ``"kivi"`` (``null``: vLLM's own pages). tests/test_vllm_plugin.py runs it."""

import json
import sys


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(spec["engine"])
    if spec["kivi"] is not None:
        engine["additional_config"] = {"kivi": spec["kivi"]}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec["dtype"], **engine)
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
