"""Decode speed of vLLM's CPU backend with and without IceCache (docs/serving.md, "Speed").

    VLLM_PLUGINS=none     .venv-serve/bin/python experiments/serving/bench_vllm.py dense  OUT.json
    VLLM_PLUGINS=icecache .venv-serve/bin/python experiments/serving/bench_vllm.py '{"budget":256,"index":"exact"}' OUT.json

(plus HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2; run from a directory without an
``icecache/`` folder). Per (context, batch): wall time of max_tokens=1 (prefill) and of max_tokens=1+NEW, greedy;
TPOT = difference / NEW. Prompts are RULER essay text cut to the context (distinct starts per batch row, so
prefix caching shares nothing).
"""

from __future__ import annotations

import json
import sys
import time

NEW = 32


def main(method: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from icecache.eval.ruler.haystack import essay_sentences
    from icecache.serving.model_dir import vllm_model_dir

    extra = {} if method == "dense" else {"additional_config": {"icecache": json.loads(method)}}
    llm = LLM(model=str(vllm_model_dir()), dtype="float32", max_model_len=8192, enforce_eager=True, seed=0, **extra)
    tok = llm.get_tokenizer()
    text_ids = tok(" ".join(essay_sentences(9000)))["input_ids"]
    llm.generate([{"prompt_token_ids": text_ids[:64]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    rows = []
    for ctx, batch in ((4096, 1), (4096, 4), (8000 - NEW, 1)):
        prompts = [{"prompt_token_ids": [1] + text_ids[100 * b + 1 : 100 * b + ctx]} for b in range(batch)]
        times = []
        for n in (1, 1 + NEW):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
            times.append(time.perf_counter() - t0)
        rows.append({"method": method, "context": ctx, "batch": batch, "prefill_s": round(times[0], 2),
                     "tpot_ms": round(1000 * (times[1] - times[0]) / NEW, 1)})
        print(rows[-1], flush=True)
    open(out_path, "w").write(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
