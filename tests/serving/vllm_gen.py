"""Greedy offline generation with vLLM in a process of its own (the serve tests start one per engine config).

    python tests/serving/vllm_gen.py REQUEST.json OUT.json

REQUEST: ``{"model": dir, "additional_config": {...} | null, "prompts": [str | [token ids]], "max_tokens": n,
"max_model_len": n}``. OUT: ``{"token_ids": [[...], ...], "texts": [...], "init_s": s, "generate_s": s}``.
Run it from a directory without an ``icecache/`` folder, or the checkout shadows the installed plugin.
"""

from __future__ import annotations

import json
import sys
import time


def main(req_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    req = json.loads(open(req_path).read())
    t0 = time.perf_counter()
    kwargs = {"additional_config": req["additional_config"]} if req.get("additional_config") is not None else {}
    llm = LLM(model=req["model"], dtype="float32", max_model_len=req.get("max_model_len", 8192), enforce_eager=True,
              seed=0, **kwargs)
    t1 = time.perf_counter()
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in req["prompts"]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=req["max_tokens"]), use_tqdm=False)
    t2 = time.perf_counter()
    res = {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
           "init_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 2)}
    open(out_path, "w").write(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
