"""Side-by-side with NVIDIA kvpress: our ``snapkv`` and ``streaming`` baselines vs its presses.

On the same prompts and model, kvpress's `SnapKVPress` / `StreamingLLMPress` compress the prefill cache to
the number of tokens our methods keep on the device (sink + window + budget per KV head); we then compare

* which prompt positions each keeps, per (layer, KV head): Jaccard overlap of the kept sets, recovered from
  kvpress's compressed cache by matching its key rows against the full prefill's;
* what each answers: task score and greedy-token agreement.

Differences by design, reported rather than hidden: our methods always keep the first ``sink`` tokens
(kvpress's SnapKV does not), and ours keep the budget fixed while decoding (tokens leaving the window are
evicted), whereas kvpress's cache grows with generated tokens. Needs the optional extra
``pip install icecache[peers]`` (kvpress, which requires transformers < 5.3).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from icecache.core.config import IceCacheConfig
from icecache.eval.harness import decode_greedy, run_prefill
from icecache.eval.methods import get_method
from icecache.eval.passkey import make_passkey, passkey_correct
from icecache.runtime.attention import use_attention
from icecache.runtime.cache import IceCache


def _press(name: str, ratio: float, cfg: IceCacheConfig):
    try:
        from kvpress import SnapKVPress, StreamingLLMPress
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the kvpress cross-check needs `pip install icecache[peers]` (kvpress)") from exc
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=cfg.window, kernel_size=5)
    return StreamingLLMPress(compression_ratio=ratio, n_sink=cfg.sink)


def _kept_positions(full: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
    """Positions of the rows of ``kept`` ``[m, D]`` inside ``full`` ``[T, D]`` (exact row matches)."""
    eq = (kept[:, None, :] == full[None, :, :]).all(-1)  # [m, T]
    return np.flatnonzero(eq.any(0).numpy())


def _our_kept(cache: IceCache, layer_idx: int, head: int, T: int) -> np.ndarray:
    """Prompt positions our method would attend at the first decode step (sink + budget selection + window)."""
    layer = cache.layers[layer_idx]
    cache.workers.wait(layer_idx)
    S, W = layer.sink, layer.window
    sinks = np.arange(0, int(layer.num_sinks[0]))
    window = np.arange(max(0, T - W), T)
    pager = layer.pagers[0][head]
    # the selection does not depend on the query for prefill-time methods (snapkv) nor exist (streaming)
    sel = pager.select(torch.zeros(1, layer.head_dim), layer.budget).positions.numpy() + S if layer.budget else np.zeros(0, np.int64)
    return np.unique(np.concatenate([sinks, sel, window]))


@torch.inference_mode()
def cross_check(model: Any, tokenizer: Any, lengths: list[int], samples: int, budgets: list[int],
                config: IceCacheConfig, seed: int = 0, progress: bool = True) -> list[dict[str, Any]]:
    """One row per (sample, method, budget)."""
    from tqdm.auto import tqdm

    cfg = config.replace(dense_layers=())  # kvpress compresses every layer
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rows = []
    bar = tqdm(total=len(lengths) * samples * len(budgets) * 2, desc="kvpress cross-check", disable=not progress)
    stop = {tokenizer.eos_token_id}
    for n in lengths:
        for i in range(samples):
            sample = make_passkey(tokenizer, n, depth=(0.1 + 0.8 * i / max(samples - 1, 1)), seed=seed * 7919 + n + i)
            ids = tokenizer(sample.prompt, return_tensors="pt")["input_ids"]
            T = ids.shape[1]
            prefill = run_prefill(model, ids, obs_window=cfg.window)
            for budget in budgets:
                keep = cfg.sink + cfg.window + budget
                ratio = 1.0 - keep / T
                for name in ("snapkv", "streaming"):
                    t0 = time.perf_counter()
                    c = cfg.replace(budget=budget)
                    ours = get_method(name).cache(model, prefill, c)
                    pressed = DynamicCache()
                    with _press(name, ratio, c)(model), use_attention(model, "sdpa"):
                        out = model(ids, past_key_values=pressed, use_cache=True, logits_to_keep=1)
                    overlaps = []
                    for layer_idx in range(text.num_hidden_layers):
                        full_k = prefill.kv.layers[layer_idx].keys[0]
                        for h in range(text.num_key_value_heads):
                            a = set(_our_kept(ours, layer_idx, h, T).tolist())
                            b = set(_kept_positions(full_k[h], pressed.layers[layer_idx].keys[0, h]).tolist())
                            overlaps.append(len(a & b) / max(len(a | b), 1))
                    toks_ours = decode_greedy(model, ours, prefill.last_logits, 8, stop)
                    ours.close()
                    toks_kv = decode_greedy(model, pressed, out.logits[0, -1].float(), 8, stop, start_position=T)
                    m = min(len(toks_ours), len(toks_kv))
                    rows.append({
                        "method": name, "budget": budget, "length": n, "tokens": T, "sample": i,
                        "kept_per_head": keep, "jaccard_mean": float(np.mean(overlaps)), "jaccard_min": float(np.min(overlaps)),
                        "ours_correct": passkey_correct(sample, tokenizer.decode(toks_ours)),
                        "kvpress_correct": passkey_correct(sample, tokenizer.decode(toks_kv)),
                        "token_agreement": sum(a == b for a, b in zip(toks_ours[:m], toks_kv[:m])) / max(m, 1),
                        "seconds": time.perf_counter() - t0,
                    })
                    bar.update(1)
    bar.close()
    return rows
