"""Make tests/serving/data/hf_reference.json: icecache's HF runtime on passkey prompts (run in the MAIN venv).

    .venv/bin/python tests/serving/make_reference.py [PROMPT_NAME ...]

The vLLM tests (tests/serving/test_vllm_plugin.py, serve venv) feed the same prompt token ids to vLLM and
compare greedy outputs with the ones stored here: full attention, and IceCache at the configs in CONFIGS.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import icecache
from icecache.core.config import IceCacheConfig

OUT = Path(__file__).parent / "data" / "hf_reference.json"
NEW_TOKENS = 24
#: the IceCache settings compared (the vLLM plugin takes the same keys in additional_config["icecache"])
CONFIGS = {
    "exact-256": {"budget": 256, "sink": 4, "window": 64, "page_size": 16, "index": "exact"},
    "mdci-256": {"budget": 256, "sink": 4, "window": 64, "page_size": 16, "index": "mdci"},
    # tight enough that the output differs from full attention: the sparse path itself is compared
    "exact-32": {"budget": 32, "sink": 4, "window": 16, "page_size": 16, "index": "exact"},
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


if __name__ == "__main__":
    main(sys.argv[1:])
