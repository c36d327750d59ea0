"""The parts of the vLLM plugin that need no vLLM: its config parsing and the vLLM-ready model directory
(the end-to-end tests are tests/serving, serve venv only)."""

from __future__ import annotations

import json

import pytest

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError, ModelLoadError
from icecache.serving import model_dir
from icecache.serving.vllm_plugin import icecache_config


def test_no_icecache_entry_means_stock_vllm():
    assert icecache_config(None) is None
    assert icecache_config({}) is None
    assert icecache_config({"other_plugin": {"x": 1}}) is None


def test_config_is_validated():
    cfg = icecache_config({"icecache": {"budget": 128, "window": 32, "index": "exact", "dense_layers": [0]}})
    assert cfg == IceCacheConfig(budget=128, window=32, index="exact", dense_layers=(0,))
    with pytest.raises(ConfigError, match=r"unknown or unsupported key\(s\) budgte, trace"):
        icecache_config({"icecache": {"budgte": 1, "trace": True}})
    with pytest.raises(ConfigError, match=r"IceCacheConfig.budget must be in \[0, 16777216\], got -1"):
        icecache_config({"icecache": {"budget": -1}})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        icecache_config({"icecache": 256})
    with pytest.raises(ConfigError, match='index "auto" is not supported'):
        icecache_config({"icecache": {"index": "auto"}})


def _fake_converted(tmp_path):
    src = tmp_path / "models" / "Model-abc"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 1, "content": "<s>"}, {"id": 2, "content": "<|im_end|>"}],
                                                    "model": {"vocab": {"a": 3}}}))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "CodeLlamaTokenizer", "eos_token": "<s>",
                                                           "model_type": "gpt2", "clean_up_tokenization_spaces": True}))
    return src


def test_vllm_model_dir_links_weights_and_fixes_the_tokenizer(tmp_path, monkeypatch):
    src = _fake_converted(tmp_path)
    monkeypatch.setattr(model_dir, "converted_dir", lambda name: src)
    out = model_dir.vllm_model_dir("any")
    assert out == src.parent / "Model-abc.vllm"
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["eos_token"], cfg["eos_token_id"]) == ("<|im_end|>", 2)
    assert cfg["clean_up_tokenization_spaces"] is False and "model_type" not in cfg
    assert model_dir.vllm_model_dir("any") == out  # made once, then reused
    assert not [p for p in src.parent.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_vllm_model_dir_needs_the_weights(tmp_path, monkeypatch):
    src = _fake_converted(tmp_path)
    (src / "model.safetensors").unlink()
    monkeypatch.setattr(model_dir, "converted_dir", lambda name: src)
    with pytest.raises(ModelLoadError, match="lacks model.safetensors"):
        model_dir.vllm_model_dir("any")


def test_converted_dir_says_how_to_convert(tmp_path, monkeypatch):
    from icecache.runtime import models

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="has not been converted yet"):
        models.converted_dir(gguf)


# ---------------------------------------------------------------------------------------------- paged KV reads
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _paged_cache(keys, values, block_size: int, transposed: bool, seed: int):
    """A vLLM-CPU-layout cache ``[num_blocks, H, block_size, 2 * D]`` holding one request's ``keys``/``values``
    ``[n, H, D]`` in shuffled blocks, written token by token (the brute-force reference); and its block row."""
    import numpy as np
    import torch

    n, H, D = keys.shape
    n_blocks = -(-n // block_size)
    total = n_blocks + 3
    row = torch.from_numpy(np.random.default_rng(seed).permutation(total)[:n_blocks].astype(np.int32))
    cache = torch.full((total, H, block_size, 2 * D), float("nan"))
    flat = cache.view(total, H, 2 * block_size * D)
    for p in range(n):
        b, off = int(row[p // block_size]), p % block_size
        for h in range(H):
            for d in range(D):
                flat[b, h, (d * block_size + off) if transposed else (off * D + d)] = keys[p, h, d]
                flat[b, h, block_size * D + off * D + d] = values[p, h, d]
    return cache, row


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), heads=st.integers(1, 3), dim=st.sampled_from([1, 4, 8]), block_size=st.sampled_from([4, 16]),
       transposed=st.booleans(), picks=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_gather_kv_heads_reads_each_heads_own_positions(n, heads, dim, block_size, transposed, picks, seed):
    """The numba gather (float32) and the torch gather both return K[positions[h], h] and V[positions[h], h]."""
    import numpy as np
    import torch

    from icecache.serving.paged_kv import _gather_kv_heads_torch, gather_kv_heads

    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g)
    cache, row = _paged_cache(keys, values, block_size, transposed, seed)
    positions = np.random.default_rng(seed).integers(0, n, size=(heads, picks)).astype(np.int64)
    want_k = torch.stack([keys[positions[h], h] for h in range(heads)])
    want_v = torch.stack([values[positions[h], h] for h in range(heads)])
    for gather in (gather_kv_heads, _gather_kv_heads_torch):
        k, v = gather(cache, row, positions, transposed)
        assert torch.equal(k, want_k) and torch.equal(v, want_v), gather.__name__
