"""kvpress rows: every press from one shared context prefill answers as kvpress's pipeline does, token for token."""

from __future__ import annotations

import pytest
import torch

from icecache import IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.eval.ruler import make_sample
from icecache.eval.ruler.peers import (
    PRESS_NAMES,
    check_press,
    compression_ratio,
    kvpress_answer,
    prefill_context,
    press_answer,
)


def test_compression_ratio_keeps_our_prompt_tokens():
    cfg = IceCacheConfig(sink=4, window=64, budget=256)
    ratio = compression_ratio(4000, 40, 256, cfg)
    assert round((1 - ratio) * 4000) + 40 == 4 + 64 + 256
    assert compression_ratio(100, 10, 256, cfg) == 0.0  # budget above the context: nothing pressed
    assert compression_ratio(10**6, 10, 1, cfg) == 0.99  # kvpress's ceiling


def test_unknown_press_is_one_line_config_error():
    with pytest.raises(ConfigError, match="unknown press 'quest'"):
        check_press("quest")


@pytest.mark.model
def test_shared_context_prefill_answers_as_the_pipeline(smollm2):
    """The same text from `press_answer` (one recorded prefill, each press's hook replayed) as from kvpress's
    pipeline end to end, for every press we report (budgets 64 and 256), with the shared context reused."""
    pytest.importorskip("kvpress")
    model, tok = smollm2
    sample = make_sample("vt", tok, 900, index=1, chat_template=bool(tok.chat_template))
    cfg = IceCacheConfig()
    context = prefill_context(model, tok, sample)
    assert len(context.calls) == model.config.num_hidden_layers
    dense_keys = [layer.keys.clone() for layer in context.cache.layers]
    n = int(context.context_ids.shape[1])
    for name, budget in zip(PRESS_NAMES, (64, 256, 256, 64)):
        reference, ref_details = kvpress_answer(model, tok, sample, name, budget, cfg)
        shared, details = press_answer(model, tok, context, sample, name, budget, cfg)
        assert shared == reference, (name, budget)
        assert details["compression_ratio"] == ref_details["compression_ratio"] > 0
        assert details["kept_context_tokens"] == int(n * (1 - details["compression_ratio"])) < n, name
    # the presses compressed copies: the shared dense context is untouched
    assert all(torch.equal(a, layer.keys) for a, layer in zip(dense_keys, context.cache.layers))
