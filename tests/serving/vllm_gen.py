"""Greedy offline generation with vLLM in a process of its own (the serve tests start one per engine config).

    python tests/serving/vllm_gen.py REQUEST.json OUT.json

REQUEST: ``{"model": dir, "additional_config": {...} | null, "prompts": [str | [token ids]], "max_tokens": n,
"max_model_len": n, "engine_args": {...}, "alone": bool, "ignore_eos": bool, "logprobs": bool}``. OUT: ``{"token_ids":
[[...], ...], "texts": [...], "init_s": s, "generate_s": s}``, plus ``"alone_token_ids"`` when ``alone``: each prompt
generated again by itself after the batch (with vLLM's prefix cache holding it: only its last token is computed),
and ``"logprobs"`` / ``"alone_logprobs"`` (each sampled token's log-probability) with ``logprobs``.
Run it from a directory without an ``icecache/`` folder, or the checkout shadows the installed plugin.
"""

from __future__ import annotations

import json
import sys
import time


def sampled_logprobs(output) -> list[float]:
    """The log-probability of each sampled token (vLLM's ``logprobs=0``: the sampled token's only)."""
    return [step[token].logprob for token, step in zip(output.token_ids, output.logprobs)]


def main(req_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    req = json.loads(open(req_path).read())
    t0 = time.perf_counter()
    kwargs = {"additional_config": req["additional_config"]} if req.get("additional_config") is not None else {}
    kwargs.update(req.get("engine_args", {}))
    llm = LLM(model=req["model"], dtype="float32", max_model_len=req.get("max_model_len", 8192), enforce_eager=True,
              seed=0, **kwargs)
    t1 = time.perf_counter()
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in req["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=req["max_tokens"], ignore_eos=req.get("ignore_eos", False),
                            logprobs=0 if req.get("logprobs") else None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    res = {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
           "init_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 2)}
    if req.get("logprobs"):
        res["logprobs"] = [sampled_logprobs(o.outputs[0]) for o in outs]
    if req.get("alone"):
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        res["alone_token_ids"] = [list(o.token_ids) for o in alone]
        if req.get("logprobs"):
            res["alone_logprobs"] = [sampled_logprobs(o) for o in alone]
    open(out_path, "w").write(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
