"""Soak: decode for a long time and check that nothing is lost, leaks or slows down.

At every step: the sparse layers' device-resident KV bytes stay what they were after prefill (dense layers
keep full KV and grow, by design). Between checkpoints: host KV bytes grow by exactly one token's K/V per
sparse layer, KV head and step. At checkpoints: the conservation invariant (every position in
exactly one of sink / window / one host page) and, optionally, host KV equal to what a full cache holds.
Reported: RSS slope next to what the cache legitimately adds per step (host KV, and the pagers' own
`index_bytes` estimate), thread counts, TPOT after warm-up vs at the end, with and without the page
selection inside each step (the part that grows with the index).

With ``reference_every=R`` a second, *reference* cache decodes in lockstep on the same thread: after each
timed soak step, one timed reference step. The reference is closed and prefilled afresh every R steps, so its
index stays as small as the soak's was after warm-up (R = the warm-up window's length: the same sizes). The
end-of-run TPOT is then compared with a warm TPOT measured at the same moments, on the same machine state:
a shared machine that slows down or speeds up over minutes moves both, a cache that decays moves only the soak.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import torch

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.runtime.attention import use_attention
from icecache.runtime.cache import IceCache


def _our_threads() -> int:
    """Live threads, not counting tqdm's progress-bar monitor (started by the first bar, never by us)."""
    return sum(1 for t in threading.enumerate() if type(t).__name__ != "TMonitor")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _index_seconds(cache: IceCache) -> float:
    """Seconds so far of the work that grows with the index: select + insert + waits for background inserts."""
    t = cache.timer.seconds
    return t.get("select", 0.0) + t.get("insert", 0.0) + cache.workers.wait_seconds


class _Reference:
    """A cache decoding in lockstep with the soak's, re-prefilled every ``every`` steps (untimed), so its index
    stays at warm-up size; its steps are timed like the soak's, right after them."""

    def __init__(self, model: Any, config: IceCacheConfig, input_ids: torch.Tensor, background_inserts: bool, every: int) -> None:
        self.model, self.config, self.input_ids, self.bg, self.every = model, config, input_ids, background_inserts, every
        self.cache: IceCache | None = None
        self.step_s: list[float] = []
        self.index_s: list[float] = []
        self.since: list[int] = []  # steps since the reference's prefill, at each timed step (1 = first)
        self._reset()

    def _reset(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.cache = IceCache(self.model.config, self.config)
        self.cache.prefetch_inserts = self.bg
        out = self.model(self.input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.tok = out.logits[0, -1].argmax().view(1, 1)
        self.cache.workers.wait_all()  # its index builds settled before the next timed step of either cache
        self.done = 0

    def step(self) -> None:
        if self.done == self.every:
            self._reset()
        c = self.cache
        idx0 = _index_seconds(c)
        t0 = time.perf_counter()
        out = self.model(self.tok, past_key_values=c, use_cache=True)
        self.tok = out.logits[0, -1].argmax().view(1, 1)
        self.step_s.append(time.perf_counter() - t0)
        self.index_s.append(_index_seconds(c) - idx0)
        self.done += 1
        self.since.append(self.done)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def report(self, warm: slice, end: slice, n_offset: int) -> dict[str, float]:
        """Medians over the soak's windows of the reference's steps past its own warm-up (its first
        ``min(50, every // 10)`` steps after each prefill are left out); ``n``: its indexed tokens per head."""
        s, ix, since = np.asarray(self.step_s), np.asarray(self.index_s), np.asarray(self.since)
        skip = min(50, self.every // 10)
        out: dict[str, float] = {"reference_every": self.every}
        for name, w in (("warm", warm), ("end", end)):
            ok = since[w] > skip
            if not ok.any():
                ok[:] = True
            out[f"ref_{name}_ms"] = float(np.median(s[w][ok]) * 1000)
            out[f"ref_{name}_without_index_ms"] = float(np.median((s - ix)[w][ok]) * 1000)
            out[f"ref_index_{name}_ms"] = float(np.median(ix[w][ok]) * 1000)
            out[f"ref_{name}_n"] = float(np.median(n_offset + since[w][ok]))
        return out


@torch.inference_mode()
def soak(model: Any, config: IceCacheConfig, prompt_tokens: int, new_tokens: int, checkpoint_every: int = 1000,
         input_ids: torch.Tensor | None = None, verify_host: bool = False, progress: bool = False, seed: int = 0,
         background_inserts: bool = True, reference_every: int = 0) -> dict[str, Any]:
    """Prefill ``prompt_tokens`` (random ids unless ``input_ids``) and decode ``new_tokens`` greedily under
    IceCache, checking invariants; returns the figures (see module docstring). ``background_inserts=False``
    inserts each token leaving the window on the decode thread (timed in the step) instead of on the worker
    while the next layers compute. ``reference_every`` > 0: interleave a reference cache re-prefilled every that
    many steps (see module docstring; doubles the run time); 0: none."""
    from tqdm.auto import tqdm

    if isinstance(reference_every, bool) or not isinstance(reference_every, int) or reference_every < 0:
        raise ConfigError(f"reference_every must be an int >= 0, got {reference_every!r}")

    if input_ids is None:
        vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
        input_ids = torch.randint(3, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    threads_start = _our_threads()
    rss_start = _rss_bytes()
    cache = IceCache(model.config, config, max_cache_len=int(input_ids.shape[1]) + new_tokens + 1)  # buffers sized once
    cache.prefetch_inserts = background_inserts
    recorded: dict[int, torch.Tensor] = {}  # layer -> [H, prompt + new tokens, D], preallocated
    filled: dict[int, int] = {}
    if verify_host:  # what a full cache would hold: every K the model hands to `update`
        original = cache.update
        total = int(input_ids.shape[1]) + new_tokens + 1

        def recording_update(k, v, layer_idx, kw=None):
            # one preallocated buffer per layer instead of a clone per step (80,000 small tensors in a
            # tiny-model soak), so the recording allocates nothing while the run is timed
            if layer_idx not in recorded:
                recorded[layer_idx] = torch.empty(k.shape[1], total, k.shape[3], dtype=k.dtype)
                filled[layer_idx] = 0
            t, f = k.shape[2], filled[layer_idx]
            recorded[layer_idx][:, f : f + t] = k[0]
            filled[layer_idx] = f + t
            return original(k, v, layer_idx, kw)

        cache.update = recording_update
    sparse = [i for i, k in enumerate(cache.kind) if k == "sparse"]
    report: dict[str, Any] = {"index": config.index, "prompt_tokens": int(input_ids.shape[1]), "new_tokens": new_tokens,
                              "conservation_checks": 0, "host_checks": 0, "dense_layers": list(config.dense_layers),
                              "background_inserts": background_inserts, "budget": config.budget, "page_size": config.page_size,
                              "sink": config.sink, "window": config.window}
    step_s, rss = [], []
    select_s: list[float] = []  # page-selection seconds inside each step (the part that grows with the index)
    stages_s: list[float] = []  # seconds of all IceCache stages and of waits for its background inserts
    index_s: list[float] = []  # select + insert + waits for background inserts: the work that grows with the index
    index_marks: list[tuple[int, int, int]] = []  # (step, pagers' index bytes, host store allocated bytes)
    ref: _Reference | None = None
    try:
        with use_attention(model):
            t0 = time.perf_counter()
            out = model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            report["prefill_seconds"] = time.perf_counter() - t0
            if reference_every:
                ref = _Reference(model, config, input_ids, background_inserts, reference_every)
            tok = out.logits[0, -1].argmax().view(1, 1)
            dev0 = None
            host_prev = None
            per_step = None
            exact = True
            bar = tqdm(total=new_tokens, desc=f"soak {config.index}", disable=not progress, unit="tok")
            for i in range(new_tokens):
                sel0 = cache.timer.seconds.get("select", 0.0)
                all0 = sum(cache.timer.seconds.values()) + cache.workers.wait_seconds
                idx0 = _index_seconds(cache)
                t1 = time.perf_counter()
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[0, -1].argmax().view(1, 1)
                step_s.append(time.perf_counter() - t1)
                select_s.append(cache.timer.seconds.get("select", 0.0) - sel0)
                stages_s.append(sum(cache.timer.seconds.values()) + cache.workers.wait_seconds - all0)
                index_s.append(_index_seconds(cache) - idx0)
                dev = cache.device_kv_bytes(("sparse",))
                if dev0 is None:
                    dev0 = dev
                    layer = cache.layers[sparse[0]]
                    per_step = len(sparse) * layer.batch_size * layer.num_kv_heads * layer.head_dim * 2 * layer.keys.element_size()
                elif dev != dev0:
                    report["device_bytes_changed_at"] = i
                    dev0 = -1
                if (i + 1) % checkpoint_every == 0 or i == new_tokens - 1:
                    cache.check_conservation()  # waits for background inserts, so host bytes are settled
                    report["conservation_checks"] += 1
                    host = cache.host_kv_bytes()
                    if host_prev is not None and host - host_prev[1] != per_step * (i - host_prev[0]):
                        exact = False
                        report.setdefault("host_growth_mismatch_at", i)
                    host_prev = (i, host)
                    idx = sum(pg.index_bytes() for li in sparse for row in cache.layers[li].pagers for pg in row)
                    alloc = sum(st.allocated_bytes() for li in sparse for row in cache.layers[li].stores for st in row)
                    index_marks.append((i, idx, alloc))
                    if verify_host:
                        for li in sparse:
                            full = recorded[li][:, : filled[li]]  # [H, T, D]
                            for h in range(full.shape[0]):
                                pos, k, _ = cache.host_kv(li, 0, h)
                                assert torch.equal(k, full[h, pos]), f"host K of layer {li} head {h} differs"
                        report["host_checks"] += 1
                    rss.append((i, _rss_bytes()))
                if ref is not None:
                    ref.step()
                bar.update(1)
            bar.close()
        report["device_bytes_constant"] = dev0 is not None and dev0 >= 0
        report["sparse_device_kv_bytes"] = cache.device_kv_bytes(("sparse",))
        report["device_kv_bytes"] = cache.device_kv_bytes()
        report["host_growth_exact"] = exact
        report["host_kv_bytes"] = cache.host_kv_bytes()
        report["host_bytes_per_step"] = per_step
    finally:
        cache.close()
        if ref is not None:
            ref.close()
    s = np.asarray(step_s)
    n = len(s)
    w0 = min(50, n // 10)
    warm, end = slice(w0, w0 + max(n // 10, 1)), slice(n - max(n // 10, 1), n)  # after warm-up; the last tenth

    def ms(x: np.ndarray, window: slice) -> float:
        return float(np.median(x[window]) * 1000)

    report["tpot_warm_ms"], report["tpot_end_ms"] = ms(s, warm), ms(s, end)
    report["tpot_drift"] = report["tpot_end_ms"] / report["tpot_warm_ms"] - 1.0
    if len(select_s) == n:  # the same windows, split: selection, the rest, the model without IceCache's stages
        sel, ice = np.asarray(select_s), np.asarray(stages_s)
        report["select_warm_ms"], report["select_end_ms"] = ms(sel, warm), ms(sel, end)
        report["tpot_drift_without_select"] = ms(s - sel, end) / ms(s - sel, warm) - 1.0
        report["model_only_warm_ms"], report["model_only_end_ms"] = ms(s - ice, warm), ms(s - ice, end)
        ix = np.asarray(index_s)
        report["index_warm_ms"], report["index_end_ms"] = ms(ix, warm), ms(ix, end)
        report["tpot_drift_without_index"] = ms(s - ix, end) / ms(s - ix, warm) - 1.0
    if ref is not None and len(ref.step_s) == n:
        report.update(ref.report(warm, end, n_offset=report["prompt_tokens"] - config.sink - config.window))
        report["tpot_drift_vs_reference"] = report["tpot_end_ms"] / report["ref_end_ms"] - 1.0
        if "index_end_ms" in report:
            ix = np.asarray(index_s)
            report["tpot_drift_vs_reference_without_index"] = ms(s - ix, end) / report["ref_end_without_index_ms"] - 1.0
    if len(rss) >= 2:
        xs, ys = np.array([r[0] for r in rss], float), np.array([r[1] for r in rss], float)
        report["rss_slope_bytes_per_step"] = float(np.polyfit(xs, ys, 1)[0])
    if len(index_marks) >= 2:  # what the pagers themselves add per step (their own estimate, `index_bytes`)
        (i0, b0, a0), (i1, b1, a1) = index_marks[0], index_marks[-1]
        report["index_bytes_per_step"] = (b1 - b0) / max(1, i1 - i0)
        # host KV blocks reserved (pages are blocks of page_size slots; split pages leave free slots)
        report["host_allocated_bytes_per_step"] = (a1 - a0) / max(1, i1 - i0)
    report["rss_start_mib"] = rss_start / 2**20
    report["rss_end_mib"] = _rss_bytes() / 2**20
    report["threads_start"], report["threads_end"] = threads_start, _our_threads()
    return report
