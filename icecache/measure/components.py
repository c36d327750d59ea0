"""Timings of the model and of the runtime's components on this machine (the ``measure_*`` functions that
do not time a pager; `icecache.measure.pagers` has those).

- **decode step** of the model vs context (a one-token forward over a cache of n random K/V tokens),
  **attention** of one layer, **LM head**, **prefill**, and what ``generate`` adds per step;
- the runtime's **sparse-attention kernel**, the **host-store writes** of a prefill job, its **sparse-layer
  code** (`IceCache` layer, `BulkLoader`, `StageTimer`; no model) and **real prefills** through ``generate``,
  full vs the runtime's pipeline.

Each returns raw samples (lists of seconds with their features), which `icecache.measure.fitting` turns into
the simulator's predictors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from icecache.measure.timing import interleaved, timeit

__all__ = [
    "filled_cache", "measure_decode_step", "measure_attention", "measure_sparse_attention", "measure_store_sync",
    "measure_lm_head", "measure_prefill", "StampStreamer", "measure_generate_step", "measure_runtime_layer",
    "measure_prefill_pipeline", "decode_insert_attr", "classmethods_timed", "layer_inserts_timed",
]


def decode_insert_attr(pager: Any) -> str:
    """The pager method a decode step's insert runs through (`HeadStore.insert_token`): ``insert_one_stored`` for a
    pager that `stores_inserts` (it also writes the store), else ``insert``. Timing this one attribute times every
    decode insert once."""
    return "insert_one_stored" if pager.stores_inserts else "insert"


@contextmanager
def classmethods_timed(kinds: set[type], attr: str, acc: dict[str, Any], what: str,
                       counts: Callable[[Any], bool] = lambda out: True) -> Iterator[None]:
    """While open, every call of the classmethod ``attr`` (``cls, pagers, *args``) of the ``kinds`` that define it
    adds its seconds to ``acc[what]`` and, when ``counts(result)``, one call per pager it served to
    ``acc[what + "s"]``; the classes are restored on exit."""
    saved = {kind: kind.__dict__[attr] for kind in kinds if attr in kind.__dict__}
    for kind, original in saved.items():
        fused = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original

        def run(cls: type, pagers: list[Any], *args: Any, fused: Callable[..., Any] = fused) -> Any:
            t0 = time.perf_counter()
            out = fused(cls, pagers, *args)
            acc[what] += time.perf_counter() - t0
            if counts(out):
                acc[what + "s"] += len(pagers)
            return out

        setattr(kind, attr, classmethod(run))
    try:
        yield
    finally:
        for kind, original in saved.items():
            setattr(kind, attr, original)


def layer_inserts_timed(kinds: set[type], acc: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """While open, every one-call layer insert (a pager class's ``insert_layer_stored``, which `HeadStore`'s
    ``insert_layer_token`` calls for all KV heads of a layer row instead of their `decode_insert_attr`) adds its
    seconds to ``acc["insert"]`` and one insert per pager it served to ``acc["inserts"]``. It calls no pager
    instance's own insert method, so nothing is counted twice."""
    return classmethods_timed(kinds, "insert_layer_stored", acc, "insert")


def filled_cache(model: Any, n: int, seed: int) -> Any:
    """A `transformers.DynamicCache` of ``model`` holding ``n`` random K/V tokens in every layer."""
    import torch
    from transformers import DynamicCache

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    kv = int(cfg.num_key_value_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(1, kv, n, d, generator=g, dtype=model.dtype)
        v = torch.randn(1, kv, n, d, generator=g, dtype=model.dtype)
        cache.update(k, v, layer)
    return cache


def measure_decode_step(model: Any, contexts: Sequence[int], reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """One-token forward with a cache of n tokens, for each n."""
    import torch

    caches = {n: filled_cache(model, n, seed) for n in contexts}
    ids = torch.tensor([[7]])

    def step(n: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                model(input_ids=ids, past_key_values=caches[n], position_ids=torch.tensor([[n]]),
                      cache_position=torch.tensor([n]), use_cache=True)

        return run

    secs = interleaved({n: step(n) for n in contexts}, reps, 1, {n: (lambda n=n: caches[n].crop(n)) for n in contexts})
    return [{"context": n, "seconds": secs[n]} for n in contexts]


def measure_attention(model: Any, tokens: Sequence[int], reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """The attention function of one layer (the model's implementation) over n keys, one query token."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    layer = model.model.layers[0].self_attn
    impl = model.config._attn_implementation
    fn = ALL_ATTENTION_FUNCTIONS.get(impl) if impl != "eager" else None
    if fn is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
    cfg = model.config
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    g = torch.Generator().manual_seed(seed)
    fns = {}
    for n in tokens:
        q = torch.randn(1, cfg.num_attention_heads, 1, d, generator=g, dtype=model.dtype)
        k = torch.randn(1, cfg.num_key_value_heads, n, d, generator=g, dtype=model.dtype)
        v = torch.randn(1, cfg.num_key_value_heads, n, d, generator=g, dtype=model.dtype)

        def att(q: Any = q, k: Any = k, v: Any = v) -> None:
            with torch.inference_mode():
                fn(layer, q, k, v, None, dropout=0.0, scaling=layer.scaling)

        fns[n] = att
    secs = interleaved(fns, max(reps, 5) * 3, warmup=2)
    return [{"kv_tokens": n, "seconds": secs[n]} for n in tokens]


def measure_sparse_attention(q_heads: int, kv_heads: int, head_dim: int, slots: Sequence[int], reps: int,
                             seed: int = 0) -> list[dict[str, Any]]:
    """The runtime's CPU sparse-attention kernel (`icecache.runtime.cpu_attention.sparse_attention_cpu`, what a
    sparse layer's ``attend`` stage runs on this machine): one decode token, ``q_heads`` query heads over
    ``kv_heads`` device buffers of ``S`` slots (sink + window + budget), for each ``S`` in ``slots``; all slots valid."""
    import torch

    from icecache.runtime.cpu_attention import sparse_attention_cpu

    g = torch.Generator().manual_seed(seed)
    rep = q_heads // kv_heads
    fns = {}
    for n in slots:
        q = torch.randn(1, kv_heads, rep, head_dim, generator=g)
        k = torch.randn(1, kv_heads, n, head_dim, generator=g)
        v = torch.randn(1, kv_heads, n, head_dim, generator=g)
        valid = torch.ones(1, kv_heads, n, dtype=torch.bool)

        def att(q: Any = q, k: Any = k, v: Any = v, valid: Any = valid) -> None:
            sparse_attention_cpu(q, k, v, valid, head_dim ** -0.5)

        fns[n] = att
    secs = interleaved(fns, max(reps, 5) * 3, warmup=2)
    return [{"slots": n, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "seconds": secs[n]} for n in slots]


def measure_store_sync(head_dim: int, dtype: Any, sizes: Sequence[int], page_size: int, reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """The host-store half of a prefill job (`icecache.runtime.store.HeadStore.sync` of a freshly built pager's
    ``n`` positions into an empty store: the K/V of every page written into its block), for each ``n``."""
    import torch

    from icecache.indexes import make_pager
    from icecache.runtime.store import HeadStore

    g = torch.Generator().manual_seed(seed)
    prepared = {}
    for n in sizes:
        k, v = torch.randn(n, head_dim, generator=g, dtype=dtype), torch.randn(n, head_dim, generator=g, dtype=dtype)
        pager = make_pager("sequential", head_dim=head_dim, page_size=page_size, seed=seed, record_moves=True)
        pager.build(k.float())
        prepared[n] = (pager.table, pager.table.take_journal(), k, v)

    def sync(n: int) -> Callable[[], None]:
        table, moves, k, v = prepared[n]
        return lambda: HeadStore(table, head_dim, dtype).sync(list(moves), k, v, first_new=0)

    secs = interleaved({n: sync(n) for n in sizes}, max(reps, 3), warmup=1)
    return [{"tokens": n, "page_size": page_size, "head_dim": head_dim, "seconds": secs[n]} for n in sizes]


def measure_lm_head(model: Any, reps: int) -> list[dict[str, Any]]:
    """Final norm + LM head + argmax for one token."""
    import torch

    h = torch.randn(1, 1, model.config.hidden_size, dtype=model.dtype)

    def head() -> None:
        with torch.inference_mode():
            model.lm_head(model.model.norm(h)).argmax(-1)

    return [{"seconds": timeit(head, max(reps, 5) * 3, warmup=2)}]


def measure_prefill(model: Any, input_ids: Any, tokens: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """Forward of the first n prompt tokens with a fresh cache."""
    import torch

    def pre(n: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():  # logits of the last token only, as generation computes them
                model(input_ids=input_ids[:, :n], use_cache=True, logits_to_keep=1)

        return run

    secs = interleaved({n: pre(n) for n in tokens}, 3, warmup=1)
    return [{"tokens": n, "seconds": secs[n]} for n in tokens]


class StampStreamer:
    """A `generate` streamer that time-stamps every put (put 0: the prompt, put k: the k-th new token)."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def put(self, value: Any) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure_generate_step(model: Any, input_ids: Any, new_tokens: int, reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """What `transformers`' ``generate`` adds to each decode step beyond the model's forward.

    ``generate`` of ``new_tokens`` greedy tokens after the prompt ``input_ids`` (a streamer time-stamps every
    token; the gaps after the first are decode steps at contexts ``T+1 .. T+new_tokens-1``), and one-token
    forwards at the mean of those contexts (as `measure_decode_step`), in alternating rounds.
    """
    import torch

    T = int(input_ids.shape[1])
    ctx = T + new_tokens // 2
    cache = filled_cache(model, ctx, seed)
    ids = torch.tensor([[7]])

    gen: list[float] = []
    fwd: list[float] = []
    for r in range(reps + 1):
        clock = StampStreamer()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
        steps = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]  # put 0: the prompt; put 1: the first token
        f = []
        for _ in range(len(steps)):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, past_key_values=cache, position_ids=torch.tensor([[ctx]]), cache_position=torch.tensor([ctx]),
                      use_cache=True)
            f.append(time.perf_counter() - t0)
            cache.crop(ctx)
        if r:  # round 0 is a warm-up
            gen += steps
            fwd += f
    return [{"context": ctx, "prompt_tokens": T, "new_tokens": new_tokens, "generate_s": gen, "forward_s": fwd}]


def _layer_config(kv_heads: int, group: int, head_dim: int) -> Any:
    """A one-layer Llama config with the attention geometry of interest (IceCache reads only the config)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads,
                       head_dim=head_dim, hidden_size=kv_heads * group * head_dim, intermediate_size=64, vocab_size=128,
                       max_position_embeddings=1 << 20)


def measure_runtime_layer(
    heads: Sequence[int], group: int, head_dim: int, dtype: Any, n: int, budget: int, page_size: int,
    new_tokens: Sequence[int], reps: int, seed: int = 0, traces: Sequence[bool] = (False, True),
) -> dict[str, list[dict[str, Any]]]:
    """Time the runtime's sparse-layer code (no model; random K/V; the ``sequential`` pager, whose costs do not
    enter these numbers) for each KV head count in ``heads``:

    - ``loader``: `BulkLoader.load` with exactly ``k`` new tokens per head among ``budget`` selected (for every
      ``k`` in ``new_tokens``), its own stage timer's gather / copy / scatter / other seconds;
    - ``layer``: whole decode-layer steps through the runtime's entry points (``IceCache.update`` and the
      registered ``icecache`` attention function, with the prefetched insert), the stage timer's seconds and the
      wall time (the untimed remainder is the per-layer overhead), without and with ``IceCacheConfig(trace=True)``
      for each flag in ``traces``. The worker pool's prefetch job is waited for between steps, outside the timed
      span.
    """
    import types

    import torch
    from transformers import DynamicCache

    from icecache.core.config import IceCacheConfig
    from icecache.runtime.attention import icecache_attention
    from icecache.runtime.cache import IceCache
    from icecache.runtime.timing import StageTimer

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out: dict[str, list[dict[str, Any]]] = {"loader": [], "layer": []}
    elt = torch.tensor([], dtype=dtype).element_size()
    for H in heads:
        for traced in traces:
            ice = IceCacheConfig(budget=budget, page_size=page_size, index="sequential", dense_layers=(), threads=1, seed=seed,
                                 trace=traced)
            with torch.inference_mode(), IceCache(_layer_config(H, group, head_dim), ice) as cache:
                layer = cache.layers[0]
                dense = DynamicCache()
                dense.update(torch.randn(1, H, n, head_dim, generator=g, dtype=dtype),
                             torch.randn(1, H, n, head_dim, generator=g, dtype=dtype), 0)
                cache.load_prefill(dense)  # the prefill's placement and index builds, as the runtime does them
                cache.workers.wait_all()
                m = len(layer.pagers[0][0])
                if not traced:  # ---- bulk loader at controlled new tokens per head
                    first = [[rng.choice(m, budget, replace=False) for _ in range(H)]]
                    layer.loader.load(layer.stores, first, [[None] * H], StageTimer())
                    for k in sorted(set(new_tokens)):
                        secs: dict[str, list[float]] = {s_: [] for s_ in ("gather", "copy", "scatter", "other")}
                        for r in range(reps + 1):
                            pos = []
                            for h in range(H):
                                res = layer.loader.resident_positions(0, h)
                                keep = rng.choice(res, budget - k, replace=False) if budget > k else res[:0]
                                free = np.setdiff1d(np.arange(m), res)
                                pos.append(np.concatenate([keep, rng.choice(free, k, replace=False)]).astype(np.int64))
                            timer = StageTimer()
                            rep_ = layer.loader.load(layer.stores, [pos], [[None] * H], timer)
                            assert rep_.tokens_copied == H * k
                            if r:  # the first call after a change of k is a warm-up
                                for s_ in secs:
                                    secs[s_].append(timer.seconds[s_])
                        out["loader"].append({"heads": H, "new_tokens": k, "selected": budget, "head_dim": head_dim,
                                              "dtype_bytes": elt, "bytes": H * k * 2 * head_dim * elt, "seconds_by_stage": secs})
                # ---- whole decode-layer steps through the runtime's entry points (prefetched inserts)
                module = types.SimpleNamespace(layer_idx=0)
                scale = head_dim ** -0.5
                rows: list[dict[str, Any]] = []
                for r in range(reps + 2):
                    k1 = torch.randn(1, H, 1, head_dim, generator=g, dtype=dtype)
                    q = torch.randn(1, H * group, 1, head_dim, generator=g, dtype=dtype)
                    cache.workers.wait(0)  # the previous step's prefetched insert, outside the timed span
                    before = dict(cache.timer.seconds)
                    t0 = time.perf_counter()
                    kk, vv = cache.update(k1, k1.clone(), 0)
                    icecache_attention(module, q, kk, vv, None, scaling=scale)
                    wall = time.perf_counter() - t0
                    stages = {s_: cache.timer.seconds[s_] - before.get(s_, 0.0) for s_ in cache.timer.seconds}
                    if r >= 2:  # step 0 inserts synchronously (nothing prefetched yet); step 1 is a warm-up
                        rows.append({"wall": wall, **stages})
                cache.workers.wait_all()
                row = {"heads": H, "group": group, "head_dim": head_dim, "n": n, "budget": budget, "trace": traced, "steps": rows}
                if not traced:  # ---- the same steps with the insert done synchronously (what the worker job runs)
                    pager_s = [0.0]
                    layer_acc = {"insert": 0.0, "inserts": 0}  # one-call layer inserts (`layer_inserts_timed`)
                    for prow in layer.pagers:
                        for pg in prow:
                            name = decode_insert_attr(pg)
                            original = getattr(pg, name)

                            def timed_insert(*a: Any, _f: Any = original, _total: list[float] = pager_s, **kw: Any) -> Any:
                                t0 = time.perf_counter()
                                try:
                                    return _f(*a, **kw)
                                finally:
                                    _total[0] += time.perf_counter() - t0
                            setattr(pg, name, timed_insert)
                    cache.prefetch_inserts = False
                    sync: list[dict[str, float]] = []
                    kinds = {type(pg) for prow in layer.pagers for pg in prow}
                    with layer_inserts_timed(kinds, layer_acc):
                        for r in range(reps + 1):
                            k1 = torch.randn(1, H, 1, head_dim, generator=g, dtype=dtype)
                            before, p0, l0 = cache.timer.seconds["insert"], pager_s[0], layer_acc["insert"]
                            kk, vv = cache.update(k1, k1.clone(), 0)
                            icecache_attention(module, torch.randn(1, H * group, 1, head_dim, generator=g, dtype=dtype), kk,
                                               vv, None, scaling=scale)
                            if r:
                                sync.append({"insert": cache.timer.seconds["insert"] - before,
                                             "pager_insert": pager_s[0] - p0 + layer_acc["insert"] - l0})
                    row["sync_inserts"] = sync
                out["layer"].append(row)
    return out


def measure_prefill_pipeline(
    model: Any, input_ids: Any, tokens: Sequence[int], pagers: Sequence[str], page_size: int, budget: int, threads: int,
    rounds: int, seed: int = 0,
) -> list[dict[str, Any]]:
    """Time to first and second token of real generations through ``model.generate``: full attention and the
    runtime's pipelined prefill with each of ``pagers`` (default `IceCacheConfig` otherwise), at each prompt
    length in ``tokens``.

    On a machine whose model compute and index builds share the same cores, an index build job inside a
    prefill runs several times slower than alone (compute's threads and the builds' worker compete for cores
    and caches), so the prefill's cost over full attention is measured here, as it happens, instead of being
    composed from isolated job times. ``rounds`` rounds after one warm-up, each over every (length, method) in
    its own shuffled order. One row per (tokens, method): ``ttft_s``/``tt2t_s`` lists, the cache's
    ``index_build_seconds`` (sum of the build jobs' wall times) and the layout (sparse layers, KV heads).
    """
    import random

    import torch

    from icecache.core.config import IceCacheConfig
    from icecache.runtime.attention import use_attention
    from icecache.runtime.cache import IceCache

    methods = ["full", *pagers]
    rows = {(n, m): {"tokens": n, "method": m, "ttft_s": [], "tt2t_s": [], "index_build_s": []} for n in tokens for m in methods}
    kv_heads = int(model.config.num_key_value_heads)
    layers = int(model.config.num_hidden_layers)

    def run(n: int, m: str) -> tuple[float, float, float]:
        ids = input_ids[:, :n]
        clock = StampStreamer()
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                  streamer=clock, pad_token_id=0)
        if m == "full":
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(**kw)
            return clock.t[1] - t0, clock.t[2] - t0, 0.0
        cfg = IceCacheConfig(index=m, budget=budget, page_size=page_size, threads=threads, seed=seed)
        with use_attention(model), IceCache(model.config, cfg) as cache:
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(**kw, past_key_values=cache)
            built = float(cache.stats().get("index_build_seconds", 0.0))
        return clock.t[1] - t0, clock.t[2] - t0, built

    for m in methods:  # warm-up: JIT compilation, allocator, thread start-up
        run(min(tokens), m)
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(rows)
        rng.shuffle(order)
        for n, m in order:
            ttft, tt2t, built = run(n, m)
            rows[n, m]["ttft_s"].append(ttft)
            rows[n, m]["tt2t_s"].append(tt2t)
            rows[n, m]["index_build_s"].append(built)
    d = IceCacheConfig()  # the defaults every run above used besides index/budget/page size/threads
    sparse = sum(1 for layer in range(layers) if layer not in d.dense_layers)
    for r in rows.values():
        r.update(sparse_layers=sparse, kv_heads=kv_heads, sink=d.sink, window=d.window, page_size=page_size, budget=budget,
                 threads=threads)
    return list(rows.values())
