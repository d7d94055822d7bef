"""Runs vLLM's CPU engine with KIVI pages in this process (the vLLM environment, .venv-vllm) through aborts, a
preemption and an oversized request, and prints as JSON what the pool held after each: ``python
tests/vllm/run_faults.py SPEC.json`` (the spec: model, dtype, engine options, kivi options). tests/test_vllm_plugin.py
runs it and checks that every fault leaves vLLM's free blocks and the plugin's exact units as they were."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and the worker in this process: state is visible


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kivi_xpu.vllm.offline import margins

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec["dtype"],
              additional_config={"kivi": spec["kivi"]}, **spec["engine"])  # fmt: skip
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    blocks = scheduler.kv_cache_manager.block_pool
    preempted = []
    preempt = scheduler._preempt_request

    def counting_preempt(request, *args, **kwargs):
        preempted.append(len(request.output_token_ids))  # answer tokens to be computed again on resumption
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting_preempt

    def prompt(length: int, seed: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[(i * 7 + seed) % 500 + 1 for i in range(length)])

    def params(new_tokens: int, logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0, detokenize=False,
                              logprobs=logprobs)  # fmt: skip

    def held() -> dict:
        ledger = scheduler.kivi_ledger
        # vLLM suffixes request ids; kept prompts' units are free blocks to vLLM
        pins = len(ledger.pins) + sum(entry.pins for entry in ledger.entries.values())
        return {"free_blocks": blocks.get_num_free_blocks(), "free_units": ledger.free_units,
                "requests": sorted(r.rsplit("-", 1)[0] for r in ledger.held), "pins": pins}  # fmt: skip

    def finish(outputs: list) -> list:
        """Steps the engine until every request is done; the outputs of finished requests."""
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        return outputs

    def step_until(request_id: str, done) -> dict:
        """Steps until ``done(held())`` for ``request_id``; what was held then."""
        for _ in range(200):
            engine.step()
            now = held()
            if done(now):
                return now
        raise RuntimeError(f"{request_id}: the state awaited never came")

    def short_request(request_id: str) -> None:  # a short request after each fault
        engine.add_request(request_id, prompt(20, 3), params(4))
        finish([])

    report = {}
    short_request("warm-up")
    report["baseline"] = held()

    # Abort mid-prefill: the prompt arrives in chunks of max_num_batched_tokens; abort after the first.
    engine.add_request("prefilling", prompt(spec["long_prompt"], 1), params(8))
    report["mid_prefill"] = step_until("prefilling", lambda now: "prefilling" in now["requests"])
    engine.abort_request(["prefilling"])
    short_request("after-prefill-abort")
    report["after_prefill_abort"] = held()

    # Abort mid-decode: after a few new tokens.
    engine.add_request("decoding", prompt(100, 2), params(64))
    decoded = []
    for _ in range(200):
        decoded += [len(o.outputs[0].token_ids) for o in engine.step()]
        if decoded and decoded[-1] >= 4:
            break
    report["mid_decode_tokens"] = decoded[-1]
    engine.abort_request(["decoding"])
    short_request("after-decode-abort")
    report["after_decode_abort"] = held()

    # Preemption: more long requests than the pages hold at once; their answers, to compare with their own generate.
    crowd = {f"crowd-{i}": prompt(spec["crowd_prompt"], 10 + i) for i in range(spec["crowd"])}
    for request_id, tokens in crowd.items():
        engine.add_request(request_id, tokens, params(spec["crowd_new"], logprobs=2))
    outputs = {o.request_id: o.outputs[0] for o in finish([])}
    report["crowd_finished"] = sorted(outputs)
    report["crowd"] = [
        {
            "prompt": crowd[i]["prompt_token_ids"],
            "tokens": list(out.token_ids),
            "margins": margins(out.logprobs),
        }
        for i, out in sorted(outputs.items())
    ]
    report["preempted_with_answer_tokens"] = preempted
    short_request("after-crowd")
    report["after_crowd"] = held()

    # Oversized: longer than the model length vLLM (and the plan) admit.
    try:
        engine.add_request("oversized", prompt(spec["engine"]["max_model_len"] + 1, 4), params(4))
        finish([])
        report["oversized_error"] = None
    except Exception as err:  # vLLM's validation error: the API server answers it with HTTP 400
        report["oversized_error"] = f"{type(err).__name__}: {err}"
    short_request("after-oversized")
    report["after_oversized"] = held()
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
