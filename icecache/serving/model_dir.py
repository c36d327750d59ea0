"""`vllm_model_dir`: a directory vLLM can load, made from icecache's converted copy of a model.

icecache converts its GGUF models once into a safetensors directory under ``$ICECACHE_CACHE``
(`icecache.runtime.models.converted_dir`; the conversion needs the main environment's transformers).
vLLM loads that directory as it is except for the tokenizer: the converted ``tokenizer_config.json`` names
``CodeLlamaTokenizer`` (what transformers 5.2 writes for a GGUF vocabulary), and transformers 5.19 (vLLM's)
rebuilds a different, wrong tokenizer from it (unknown-token ids between words). The vLLM directory is a
sibling of the converted one (``<entry>.vllm``): links to its files plus a rewritten ``tokenizer_config.json``
that names ``PreTrainedTokenizerFast`` (read straight from ``tokenizer.json``) and the end-of-sequence token of
``config.json``. It is written under a temporary name and renamed, so a half-written one is never used.

Run as ``python -m icecache.serving.model_dir [name]`` it prints the directory (made if needed).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from icecache.core.errors import ModelLoadError
from icecache.runtime.models import DEFAULT_MODEL, converted_dir

#: files of the converted directory that vLLM reads (linked, not copied: the weights are ~0.5 GB)
_LINKED = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "chat_template.jinja")
_FORMAT = 1  # bump when the directory's content changes; an older one is rebuilt


def vllm_model_dir(name: str | os.PathLike | None = DEFAULT_MODEL) -> Path:
    """The vLLM-ready directory of model ``name`` (a name from `icecache.runtime.models.MODELS` or a ``.gguf``
    file that `icecache.load_model` has converted), made on first use. Raises `ModelLoadError` when the model
    has not been converted yet."""
    src = converted_dir(name)
    out = src.parent / f"{src.name}.vllm"
    stamp = out / "icecache-vllm.json"
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("format") == _FORMAT and all((out / f).exists() for f in _present(src)):
                return out
        except ValueError:
            pass
        shutil.rmtree(out, ignore_errors=True)
    tmp = src.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in _present(src):
            (tmp / f).symlink_to(src / f)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(src), indent=1, ensure_ascii=False))
        (tmp / "icecache-vllm.json").write_text(json.dumps({"format": _FORMAT, "source": str(src)}, indent=1))
        try:
            os.replace(tmp, out)
        except OSError:  # another process made it first
            if not stamp.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _present(src: Path) -> list[str]:
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (src / f).is_file()]
    if missing:
        raise ModelLoadError(f"the converted model {src} lacks {', '.join(missing)}. Fix: delete it and run icecache.load_model() again")
    return [f for f in _LINKED if (src / f).is_file()]


def tokenizer_config(src: Path) -> dict:
    """The converted ``tokenizer_config.json`` of ``src`` made loadable by any transformers 5.x: a fast
    tokenizer read from ``tokenizer.json``, ``config.json``'s end-of-sequence token, no space clean-up."""
    try:
        cfg = json.loads((src / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    model_cfg = json.loads((src / "config.json").read_text())
    eos_id = model_cfg.get("eos_token_id")
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    cfg.pop("model_type", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["clean_up_tokenization_spaces"] = False
    if eos_id is not None:
        token = _token_of(src / "tokenizer.json", int(eos_id))
        if token is not None:
            cfg["eos_token"], cfg["eos_token_id"] = token, int(eos_id)
    return cfg


def _token_of(tokenizer_json: Path, token_id: int) -> str | None:
    """The text of token ``token_id`` in a tokenizers ``tokenizer.json`` (added tokens, then the vocabulary)."""
    tok = json.loads(tokenizer_json.read_text())
    for added in tok.get("added_tokens", []):
        if added.get("id") == token_id:
            return added.get("content")
    vocab = (tok.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):
        for text, i in vocab.items():
            if i == token_id:
                return text
    return None


if __name__ == "__main__":
    print(vllm_model_dir(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
