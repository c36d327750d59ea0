"""A SentencePiece-BPE tokenizer rebuilt from a GGUF file's vocabulary (for Gemma-3 GGUF files).

transformers 5.2 converts Gemma GGUF vocabularies into a BPE tokenizer without merges, which splits text
into single characters (measured: "The capital of France is" -> 24 tokens, and the model answers nonsense).
llama.cpp's "llama" (SentencePiece) tokenizer type stores pieces with scores equal to their merge priority;
we recover the merges from them the standard way: every split of a piece into two pieces of the vocabulary
is a merge, ranked by the merged piece's score (then the parts' scores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _field_strings(reader: Any, key: str) -> list[str]:
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]


def _field_array(reader: Any, key: str) -> np.ndarray:
    f = reader.fields[key]
    return np.array([f.parts[i][0] for i in f.data])


def _field_scalar(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    part = f.parts[f.data[0]]
    return part[0] if hasattr(part, "__len__") and not isinstance(part, (bytes, str)) else part


def spm_bpe_tokenizer(gguf_path: str | Path) -> Any:
    """A `PreTrainedTokenizerFast` equivalent to the GGUF file's SentencePiece-BPE tokenizer."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    r = GGUFReader(str(gguf_path))
    if bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode() != "llama":
        raise ValueError(f"{gguf_path}: not a SentencePiece ('llama') tokenizer")
    tokens = _field_strings(r, "tokenizer.ggml.tokens")
    scores = _field_array(r, "tokenizer.ggml.scores").astype(np.float64)
    types = _field_array(r, "tokenizer.ggml.token_type").astype(np.int64)  # 1 normal, 3 control, 4 user, 6 byte
    bos = int(_field_scalar(r, "tokenizer.ggml.bos_token_id", 2))
    eos = int(_field_scalar(r, "tokenizer.ggml.eos_token_id", 1))
    unk = int(_field_scalar(r, "tokenizer.ggml.unknown_token_id", 3))
    pad = int(_field_scalar(r, "tokenizer.ggml.padding_token_id", 0))
    add_bos = bool(_field_scalar(r, "tokenizer.ggml.add_bos_token", True))

    vocab = {t: i for i, t in enumerate(tokens)}
    normal = types == 1
    merges = []
    for i in np.flatnonzero(normal):
        piece = tokens[i]
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is not None and ib is not None and normal[ia] and normal[ib]:
                merges.append((-scores[i], -scores[ia], -scores[ib], a, b))
    merges.sort()
    model = BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=tokens[unk], byte_fallback=True,
                fuse_unk=True, dropout=None)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [AddedToken(tokens[i], special=True, normalized=False) for i in np.flatnonzero(types == 3)]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in np.flatnonzero(types == 4)]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=tokens[bos], eos_token=tokens[eos], unk_token=tokens[unk], pad_token=tokens[pad],
        add_bos_token=add_bos, padding_side="left",
    )
