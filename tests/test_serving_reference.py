"""The vLLM tests' HF-runtime reference (``tests/serving/data/hf_reference.json``) still equals today's runtime.

The serve venv's tests compare vLLM with the plugin against that file; if an index or runtime change moved the
HF runtime's outputs, those tests would compare against a stale answer. `make serve-reference` regenerates it.
Here: one prompt (the essay, where the tight config departs from full attention, so the sparse path itself is
compared), full attention and two sparse configs, greedy, token for token.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SERVING = Path(__file__).resolve().parent / "serving"
PROMPT = "essay-3k"
CONFIGS = ("full", "exact-32", "mdci-256")


def _make_reference_module():
    spec = importlib.util.spec_from_file_location("make_reference", SERVING / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", CONFIGS)
def test_the_stored_hf_reference_is_todays_runtime(smollm2, config):
    import icecache
    from icecache.core.config import IceCacheConfig

    model, tok = smollm2
    reference = json.loads((SERVING / "data" / "hf_reference.json").read_text())
    stored = next(p for p in reference["prompts"] if p["name"] == PROMPT)
    text = dict(_make_reference_module().PROMPTS)[PROMPT]
    assert tok(text)["input_ids"] == stored["prompt_token_ids"], "the prompt itself changed: run `make serve-reference`"
    cfg = None if config == "full" else IceCacheConfig(**reference["configs"][config])
    got = icecache.generate(model, tok, text, config=cfg, max_new_tokens=reference["new_tokens"], return_result=True).token_ids
    assert got == stored["outputs"][config], f"{config}: the HF runtime no longer gives the stored reference; run `make serve-reference`"
