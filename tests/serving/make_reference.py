"""Make the HF-runtime references of the vLLM tests (run in the MAIN venv).

    .venv/bin/python tests/serving/make_reference.py [PROMPT_NAME ...]   # data/hf_reference.json
    .venv/bin/python tests/serving/make_reference.py --tasks             # data/hf_tasks_reference.json

The vLLM tests (tests/serving/test_vllm_plugin.py, serve venv) feed the same prompt token ids to vLLM and
compare greedy outputs with the ones stored here: full attention, and IceCache at the configs in CONFIGS.
``--tasks``: the 4k passkey prompts of `icecache.eval.passkey` (five depths) and two RULER samples of each of
the 8 NIAH tasks at 4k (`icecache.eval.ruler`, chat template as the RULER runner uses it), with full attention
and IceCache's default config (M-DCI, budget 256), each with its score.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import icecache
from icecache.core.config import IceCacheConfig

OUT = Path(__file__).parent / "data" / "hf_reference.json"
TASKS_OUT = Path(__file__).parent / "data" / "hf_tasks_reference.json"
TASK_NEW_TOKENS = 48  # enough for every NIAH answer (4 values of 7 digits, 3 UUIDs) after the answer prefix
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
NIAH_SAMPLES = 2
NEW_TOKENS = 24
#: the IceCache settings compared (the vLLM plugin takes the same keys in additional_config["icecache"])
CONFIGS = {
    "exact-256": {"budget": 256, "sink": 4, "window": 64, "page_size": 16, "index": "exact"},
    "mdci-256": {"budget": 256, "sink": 4, "window": 64, "page_size": 16, "index": "mdci"},
    # tight enough that the output differs from full attention: the sparse path itself is compared
    "exact-32": {"budget": 32, "sink": 4, "window": 16, "page_size": 16, "index": "exact"},
    # the adaptive budget: pages cut at half the estimated attention mass (the essay departs from mdci-256)
    "mdci-256-top_p": {"budget": 256, "sink": 4, "window": 64, "page_size": 16, "index": "mdci", "top_p": 0.5},
}
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(key: int, repeats: int, depth: float) -> str:
    """A passkey-retrieval prompt: ``repeats`` filler sentences with the key hidden at ``depth`` (0..1)."""
    at = int(repeats * depth)
    parts = [FILLER] * repeats
    parts.insert(at, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            + "".join(parts) + "What is the pass key? The pass key is")


def essay_prompt(words: int) -> str:
    """RULER's essay haystack cut after ``words`` words (mid-sentence): the model continues free text, where the
    tight config's output differs from full attention."""
    from icecache.eval.ruler.haystack import essay_sentences

    return " ".join(essay_sentences(words))


PROMPTS = [("passkey-3k", passkey_prompt(71432, 150, 0.3)), ("essay-3k", essay_prompt(2400))]


def main(only: list[str]) -> None:
    """Recompute every prompt, or only the named ones (the others are kept from the stored file)."""
    model, tok = icecache.load_model()
    old = {p["name"]: p for p in json.loads(OUT.read_text())["prompts"]} if only and OUT.is_file() else {}
    out = {"command": "python tests/serving/make_reference.py (icecache main venv, transformers "
                      f"{__import__('transformers').__version__}, fp32)", "new_tokens": NEW_TOKENS, "configs": CONFIGS,
           "prompts": []}
    for name, text in PROMPTS:
        if only and name not in only and name in old:
            out["prompts"].append(old[name])
            continue
        ids = tok(text)["input_ids"]
        rec = {"name": name, "prompt_token_ids": ids, "outputs": {}}
        t0 = time.perf_counter()
        rec["outputs"]["full"] = icecache.generate(model, tok, text, config=None, max_new_tokens=NEW_TOKENS, return_result=True).token_ids
        for cname, cfg in CONFIGS.items():
            res = icecache.generate(model, tok, text, config=IceCacheConfig(**cfg), max_new_tokens=NEW_TOKENS, return_result=True)
            rec["outputs"][cname] = res.token_ids
        print(name, len(ids), "tokens", f"{time.perf_counter() - t0:.1f}s", tok.decode(rec["outputs"]["full"]), file=sys.stderr)
        out["prompts"].append(rec)
    OUT.write_text(json.dumps(out) + "\n")


def task_prompts(tok: object) -> list[tuple[str, str, object]]:
    """(name, prompt text, scorer of a completion) of the passkey and RULER NIAH prompts at 4k."""
    from icecache.eval.passkey import make_passkey, passkey_correct
    from icecache.eval.ruler import make_sample, score_sample
    from icecache.eval.ruler.niah import NIAH_TASKS

    out = []
    for i, depth in enumerate(PASSKEY_DEPTHS):
        pk = make_passkey(tok, 4096, depth, seed=i)
        out.append((f"passkey-4k-d{depth}", pk.prompt, lambda text, pk=pk: float(passkey_correct(pk, text))))
    for task in NIAH_TASKS:
        for index in range(NIAH_SAMPLES):
            smp = make_sample(task, tok, 4096, index=index, chat_template=True)
            out.append((f"{task}-4k-{index}", smp.prompt, lambda text, smp=smp: score_sample(smp, text)))
    return out


def main_tasks() -> None:
    """Full attention and IceCache's default config on `task_prompts`."""
    model, tok = icecache.load_model()
    configs = {"full": None, "mdci-256": IceCacheConfig()}
    out = {"command": "python tests/serving/make_reference.py --tasks (icecache main venv, transformers "
                      f"{__import__('transformers').__version__}, fp32)", "new_tokens": TASK_NEW_TOKENS,
           "configs": {"mdci-256": {k: getattr(IceCacheConfig(), k) for k in ("budget", "sink", "window", "page_size", "index")}},
           "prompts": []}
    for name, text, scorer in task_prompts(tok):
        t0 = time.perf_counter()
        rec = {"name": name, "prompt_token_ids": tok(text)["input_ids"], "outputs": {}, "scores": {}}
        for cname, cfg in configs.items():
            res = icecache.generate(model, tok, text, config=cfg, max_new_tokens=TASK_NEW_TOKENS, chat=False, return_result=True)
            rec["outputs"][cname] = res.token_ids
            rec["scores"][cname] = scorer(tok.decode(res.token_ids, skip_special_tokens=True))
        print(name, len(rec["prompt_token_ids"]), "tokens", f"{time.perf_counter() - t0:.1f}s", rec["scores"], file=sys.stderr)
        out["prompts"].append(rec)
    TASKS_OUT.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--tasks"]:
        main_tasks()
    else:
        main(sys.argv[1:])
