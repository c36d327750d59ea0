"""``python -m icecache.sim calibrate``: time the real components on this machine and write a profile.

What is timed (median of ``reps`` runs after one warm-up; every raw sample is kept in the profile):

- **decode step** of the embedded model vs context: a one-token forward with a `transformers.DynamicCache`
  prefilled (random K/V, the values do not change the time) to n tokens, cropped back after each run;
- **attention** alone of one layer vs KV tokens (transformers' SDPA path with the model's GQA layout);
- **LM head** (final norm + LM head + argmax) and **prefill** of n prompt tokens;
- **pagers** (every registered one; ``mdci`` when present): build, select (the GQA group's queries) and
  one-token insert per KV head, at several sizes, page sizes and budgets, on real keys and queries of the
  model (post-RoPE, captured from a prefill of library text; sizes beyond the captured length join the keys
  of further layers);
- **thread pool**: the KV heads' selects on 1..T threads, giving the pool's parallel efficiency; and the
  *background share*: how much a background thread doing index work (mdci inserts during decode steps, index
  builds during a prefill) slows the caller's thread down per second of that work (2 cores, the GIL);
- **pagers inside the runtime's decode** (component ``decode_index``): every pager's select and insert timed
  in real decode steps of the runtime over prompts of n indexed tokens per head (the model's work and the
  other heads' indexes run between two selects of one index: colder caches than the round-robin
  `measure_pager` timings); `icecache.sim.costs.MeasuredCosts` scales its select and insert costs by it;
- **runtime layer** (component ``loader``): the runtime's own sparse-layer code (`icecache.runtime`:
  `IceCache` layer, `BulkLoader`, `HeadStore`, `StageTimer`) on random K/V without a model, for 1 and the
  model's number of KV heads: the bulk loader at controlled numbers of new tokens per head (its gather,
  copy, scatter and bookkeeping timers), and whole decode-layer steps (update + attend) whose "insert" timer
  gives the window append and whose untimed remainder (wrappers, accounting, prefetch submission) gives the
  per-layer overhead.

The machine is shared and the numbers are noisy; the load average before and after is recorded.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from icecache.core.errors import ConfigError
from icecache.sim.costs import CalibrationProfile, Predictor, fit_predictor, pager_code_hashes, software_versions
from icecache.sim.shapes import ModelShape, shape_from_config, shape_to_dict


@dataclass(frozen=True)
class CalibrationSettings:
    """What `run_calibration` measures (token counts, repetitions, time limits in seconds)."""

    contexts: tuple[int, ...] = (128, 512, 1024, 2048, 4096, 8192)
    attention_tokens: tuple[int, ...] = (64, 256, 1024, 4096, 8192)
    prefill_tokens: tuple[int, ...] = (256, 512, 1024, 2048)
    qk_tokens: int = 8192
    pager_sizes: tuple[int, ...] = (1024, 4096, 16384, 65536, 131072, 240000)
    page_sizes: tuple[int, ...] = (8, 16, 32)
    budgets: tuple[int, ...] = (64, 256)
    insert_reps: int = 20
    pool_threads: tuple[int, ...] = (1, 2, 3)
    pool_size: int = 4096
    #: generate's per-step overhead (component "model"): prompt tokens and new tokens per generate call
    generate_prompt_tokens: int = 256
    generate_new_tokens: int = 24
    #: runtime layer (component "loader"): indexed tokens, new tokens per head per load (budget: max(budgets))
    runtime_layer_n: int = 4096
    runtime_new_tokens: tuple[int, ...] = (0, 4, 16, 64, 256)
    #: the runtime's CPU sparse-attention kernel (component "loader"): device slots (sink + window + budget)
    sparse_slots: tuple[int, ...] = (96, 192, 384, 768, 1536)
    #: host-store writes of one prefill job (component "loader"): tokens per KV head
    store_sync_tokens: tuple[int, ...] = (1024, 4096, 16384)
    #: real prefills, full vs the runtime's pipeline with each pager (component "pipeline"): prompt tokens, rounds
    pipeline_tokens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    pipeline_rounds: int = 3
    #: pagers inside the runtime's decode (component "decode_index"): indexed tokens per head, timed steps, and
    #: the dense layers (None: `IceCacheConfig`'s default)
    decode_sizes: tuple[int, ...] = (1024, 4096, 8192, 16384, 24000)
    decode_steps: int = 24
    decode_rounds: int = 2
    decode_dense_layers: tuple[int, ...] | None = None
    #: background share (component "pool"): decode context and prefill length of the foreground
    background_context: int = 1024
    background_prefill_tokens: int = 256
    reps: int = 9
    statistic: str = "p25"
    pager_time_limit_s: float = 90.0
    #: pagers to time: those the simulated variants use (icecache: mdci, quest: sequential); None = all registered
    pagers: tuple[str, ...] | None = ("mdci", "sequential")
    seed: int = 0

    @classmethod
    def quick(cls) -> "CalibrationSettings":
        """A few seconds' worth (tests and smoke runs; too small to fit reliable costs)."""
        return cls(
            contexts=(32, 64, 128), attention_tokens=(32, 128, 256), prefill_tokens=(16, 32, 64), qk_tokens=64,
            pager_sizes=(128, 256), page_sizes=(8, 16), budgets=(16, 32), insert_reps=3, pool_threads=(1, 2),
            pool_size=128, runtime_layer_n=256, runtime_new_tokens=(0, 4, 16), sparse_slots=(16, 64), store_sync_tokens=(64, 256), background_context=32, generate_prompt_tokens=16,
            pipeline_tokens=(96, 160), pipeline_rounds=1, decode_sizes=(64, 128), decode_steps=2, decode_rounds=1,
            generate_new_tokens=6,
            background_prefill_tokens=16, reps=2, pager_time_limit_s=10.0,
        )


def machine_info() -> dict[str, Any]:
    """CPU model, usable CPUs, OS and host name, torch threads, load average."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:
        ncpu = os.cpu_count() or 1
    return {
        "cpu_model": cpu,
        "cpu_count": ncpu,
        "platform": platform.platform(),
        "host": platform.node(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def timeit(fn: Callable[[], Any], reps: int, warmup: int = 1, after: Callable[[], Any] | None = None) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn`` after ``warmup`` calls (``after`` runs untimed after each)."""
    out = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if after is not None:
            after()
        if i >= warmup:
            out.append(dt)
    return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


#: Statistic each predictor is fitted to. The 25th percentile: timings on a shared machine have a long upper
#: tail (other users' bursts); a low percentile estimates the undisturbed cost more stably than the median.
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "p25": lambda xs: float(np.percentile(xs, 25)),
    "median": _median,
    "min": lambda xs: float(min(xs)),
}


def interleaved(fns: dict[Any, Callable[[], Any]], reps: int, warmup: int = 1,
                after: dict[Any, Callable[[], Any]] | None = None) -> dict[Any, list[float]]:
    """`timeit` over several functions in rounds (one call of each per round), so that a burst of load from
    another process spreads over all points instead of spoiling one."""
    out: dict[Any, list[float]] = {k: [] for k in fns}
    for i in range(warmup + reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if after and k in after:
                after[k]()
            if i >= warmup:
                out[k].append(dt)
    return out


# ---------------------------------------------------------------------------------------------- model parts
def _filled_cache(model: Any, n: int, seed: int) -> Any:
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

    caches = {n: _filled_cache(model, n, seed) for n in contexts}
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
        prepared[n] = (pager.table, pager.table.take_moves(), k, v)

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


class _StampStreamer:
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
    cache = _filled_cache(model, ctx, seed)
    ids = torch.tensor([[7]])

    gen: list[float] = []
    fwd: list[float] = []
    for r in range(reps + 1):
        clock = _StampStreamer()
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


def capture_qk(model: Any, input_ids: Any, timing: dict[str, float] | None = None) -> tuple[Any, Any]:
    """Post-RoPE queries ``[L, Hq, n, d]`` and keys ``[L, Hkv, n, d]`` of one prefill (float32).

    ``timing``, when given, receives ``forward_s``: the wall time of the forward pass itself."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out.detach())))
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)  # as generation's prefill
            if timing is not None:
                timing["forward_s"] = time.perf_counter() - t0
            n = input_ids.shape[1]
            pos = torch.arange(n).unsqueeze(0)
            h = torch.zeros(1, n, cfg.hidden_size, dtype=model.dtype)
            cos, sin = model.model.rotary_emb(h, pos)
            qs, ks = [], []
            cache = out.past_key_values
            for i in range(cfg.num_hidden_layers):
                q = captured[i].view(1, n, -1, d).transpose(1, 2)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                qs.append(q[0].float())
                ks.append(cache.layers[i].keys[0].float())
    finally:
        for hk in hooks:
            hk.remove()
    return torch.stack(qs), torch.stack(ks)


def prompt_ids(tokenizer: Any, n: int) -> Any:
    """``n`` tokens of Python's own documentation text (``pydoc_data.topics``), no chat template."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] < n:
        raise ConfigError(f"library text gives only {ids.shape[1]} tokens, {n} asked")
    return ids[:, :n]


# ---------------------------------------------------------------------------------------------- pagers
class KeyPool:
    """Real keys and queries for pager timing: head 0's group of successive layers, concatenated."""

    def __init__(self, q: Any, k: Any) -> None:
        import torch

        self.g = q.shape[1] // k.shape[1]
        self.keys = torch.cat([k[l, 0] for l in range(k.shape[0])])  # [L * n, d]
        self.queries = torch.cat([q[l, : self.g] for l in range(q.shape[0])], dim=1)  # [g, L * n, d]
        self.d = k.shape[-1]

    def keys_for(self, n: int, offset: int = 0) -> Any:
        if offset + n > self.keys.shape[0]:
            raise ConfigError(f"key pool holds {self.keys.shape[0]} keys, {offset + n} asked")
        return self.keys[offset : offset + n]

    def query(self, i: int) -> Any:
        return self.queries[:, i % self.queries.shape[1]]


def measure_pager(
    name: str, pool: KeyPool, sizes: Sequence[int], page_sizes: Sequence[int], budgets: Sequence[int], reps: int,
    insert_reps: int, time_limit_s: float, seed: int = 0, log: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Build / select / insert times of pager ``name``.

    Builds go from small to large n and stop when ``time_limit_s`` is spent; then the selects of every built
    (n, page size) and budget are timed in interleaved rounds, then the one-token inserts.
    """
    from icecache.indexes import make_pager

    out: dict[str, list[dict[str, Any]]] = {"build": [], "select": [], "insert": []}
    warm = make_pager(name, head_dim=pool.d, page_size=min(page_sizes), seed=seed)  # JIT compilation, caches
    warm.build(pool.keys_for(min(256, pool.keys.shape[0] - 2)))
    warm.select(pool.query(0), min(budgets))
    warm.insert(pool.keys_for(1, offset=min(256, pool.keys.shape[0] - 2)))
    t_start = time.perf_counter()
    built: dict[tuple[int, int], Any] = {}
    for n in sorted(sizes):
        if n > pool.keys.shape[0] - insert_reps - 2:
            log(f"  {name}: n={n} exceeds the key pool, skipped")
            continue
        if time.perf_counter() - t_start > time_limit_s:
            log(f"  {name}: time limit reached before n={n}")
            break
        keys = pool.keys_for(n)
        for P in page_sizes:
            b = []
            for _ in range(3):
                pager = make_pager(name, head_dim=pool.d, page_size=P, seed=seed)
                t0 = time.perf_counter()
                pager.build(keys)
                b.append(time.perf_counter() - t0)
                if sum(b) > 1.0:  # expensive builds: fewer repetitions
                    break
            built[(n, P)] = pager
            out["build"].append({"n": n, "page_size": P, "seconds": b})
        log(f"  {name}: n={n} built ({min(b) * 1e3:.1f} ms at page {page_sizes[-1]})")
    counter = iter(range(10**9))
    # budget outermost: consecutive calls always query different indexes, as in decode (where a select follows
    # those of the other heads and layers); the same index twice in a row would time the second call cache-hot
    fns = {
        (n, P, B): (lambda pg=pg, B=B, n=n: pg.select(pool.query(next(counter) * 37 + n), B))
        for B in budgets
        for (n, P), pg in built.items()
    }
    secs = interleaved(fns, reps, warmup=1)
    for (n, P, B), xs in secs.items():
        out["select"].append({"n": n, "budget": B, "page_size": P, "seconds": xs})
    mid_p = sorted(page_sizes)[len(page_sizes) // 2]
    ins = {n: pg for (n, P), pg in built.items() if P == mid_p}
    extra = {n: pool.keys_for(insert_reps + 1, offset=n) for n in ins}
    pos = {n: iter(range(insert_reps + 1)) for n in ins}
    secs = interleaved({n: (lambda n=n: (lambda j: ins[n].insert(extra[n][j : j + 1]))(next(pos[n]))) for n in ins}, insert_reps, 1)
    for n, xs in secs.items():
        out["insert"].append({"n": n, "seconds": xs})
    return out


def _default_sink_window() -> int:
    from icecache.core.config import IceCacheConfig

    d = IceCacheConfig()
    return d.sink + d.window


def measure_decode_index(
    model: Any, input_ids: Any, pager: str, sizes: Sequence[int], steps: int, budget: int, page_size: int,
    dense_layers: Sequence[int] | None = None, rounds: int = 1, seed: int = 0, log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """The pager's select and insert *inside the runtime's decode* (component ``decode_index``).

    For each n in ``sizes`` (``rounds`` passes over the sizes, so that a slow spell of a shared machine does not
    land on one size): a real generation through `IceCache` (index ``pager``, inserts on the decode thread)
    over a prompt of ``n + sink + window`` tokens of ``input_ids`` (n indexed tokens per KV head), then
    ``steps`` timed greedy decode steps after 2 warm-up steps; every pager's ``select_arrays`` and ``insert``
    is wrapped with a timer. `measure_pager` times one index at a time, round robin over a few sizes: warmer
    caches and a quieter process than a decode step, where the model's work and every other head's index run
    between two selects of one index (on the tiny model at 20k keys per head, 0.14 vs 0.27 ms per select of
    ``exact``). Indexes here are built at n by the prefill, as in a fresh generation.

    Returns one row per n: ``seconds`` (per step, the mean select of one KV head's pager),
    ``insert_seconds`` (the mean one-token pager insert), the layout and ``step_seconds`` (the whole step).
    """
    import torch

    from icecache.core.config import IceCacheConfig
    from icecache.runtime.cache import IceCache
    from icecache.runtime.generate import icecache_attention

    if steps < 1 or rounds < 1:
        raise ConfigError(f"decode index timing needs steps >= 1 and rounds >= 1, got {steps} and {rounds}")
    kw = {} if dense_layers is None else {"dense_layers": tuple(dense_layers)}
    cfg = IceCacheConfig(index=pager, budget=budget, page_size=page_size, seed=seed, **kw)
    rows: dict[int, dict[str, Any]] = {}
    for n in [n for _ in range(rounds) for n in sorted(sizes)]:
        tokens = n + cfg.sink + cfg.window
        if tokens > input_ids.shape[1]:
            if n not in rows:
                log(f"  {pager}: decode index at n={n} needs {tokens} prompt tokens, {input_ids.shape[1]} given; skipped")
            rows[n] = {}
            continue
        acc = {"select": 0.0, "insert": 0.0, "selects": 0, "inserts": 0}

        def timed(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
            def run(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    acc[what] += time.perf_counter() - t0
                    acc[what + "s"] += 1
            return run

        sel_s: list[float] = []
        ins_s: list[float] = []
        step_s: list[float] = []
        with torch.inference_mode(), icecache_attention(model), IceCache(model.config, cfg) as cache:
            cache.prefetch_inserts = False  # the insert on the decode thread, timed in the step
            logits = model(input_ids[:, :tokens], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            cache.pipeline.wait_all()
            jobs = 0
            for layer in cache.layers:
                for row in getattr(layer, "pagers", None) or []:
                    for pg in row:
                        pg.select_arrays = timed(pg.select_arrays, "select")
                        pg.insert = timed(pg.insert, "insert")
                        jobs += 1
            tok = logits[0, -1].argmax().view(1, 1)
            for step in range(steps + 2):
                a0 = dict(acc)
                t0 = time.perf_counter()
                tok = model(tok, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
                wall = time.perf_counter() - t0
                if acc["selects"] - a0["selects"] != jobs or acc["inserts"] - a0["inserts"] not in (0, jobs):
                    raise RuntimeError(f"decode index timing: {acc['selects'] - a0['selects']} selects and "
                                       f"{acc['inserts'] - a0['inserts']} inserts in a step of {jobs} pagers (internal bug)")
                if step >= 2:
                    sel_s.append((acc["select"] - a0["select"]) / jobs)
                    ins_s.append((acc["insert"] - a0["insert"]) / jobs)
                    step_s.append(wall)
        row = rows.setdefault(n, {"n": n, "budget": budget, "page_size": page_size, "pagers_per_step": jobs, "prompt_tokens": tokens,
                                  "seconds": [], "insert_seconds": [], "step_seconds": []})
        row["seconds"] += sel_s
        row["insert_seconds"] += ins_s
        row["step_seconds"] += step_s
        log(f"  {pager}: in the runtime at n={n}: select {statistics.median(sel_s) * 1e3:.3f} ms, insert "
            f"{statistics.median(ins_s) * 1e3:.3f} ms per pager ({jobs} per step), step {statistics.median(step_s) * 1e3:.1f} ms")
    return [r for n, r in sorted(rows.items()) if r]


def measure_pool(
    name: str, pool: KeyPool, jobs: int, n: int, page_size: int, budget: int, threads: Sequence[int], reps: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Makespan of ``jobs`` selects (one per KV head) on thread pools of each size."""
    from icecache.indexes import make_pager

    pagers = []
    for j in range(jobs):
        p = make_pager(name, head_dim=pool.d, page_size=page_size, seed=seed)
        p.build(pool.keys_for(n, offset=j * n % max(pool.keys.shape[0] - n, 1)))
        pagers.append(p)
    qs = [pool.query(31 * j) for j in range(jobs)]
    executors = {T: ThreadPoolExecutor(max_workers=T) for T in threads}
    try:
        fns: dict[int, Callable[[], Any]] = {
            T: (lambda ex=ex: list(ex.map(lambda j: pagers[j].select(qs[j], budget), range(jobs)))) for T, ex in executors.items()
        }
        fns[0] = lambda: pagers[0].select(qs[0], budget)
        secs = interleaved(fns, reps, warmup=1)
    finally:
        for ex in executors.values():
            ex.shutdown()
    return [{"threads": T, "jobs": jobs if T else 1, "n": n, "seconds": secs[T]} for T in fns]


# ---------------------------------------------------------------------------------------------- runtime layer
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

    from icecache.runtime.attention import icecache_attention

    import torch

    from icecache.core.config import IceCacheConfig
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
                layer.update(torch.randn(1, H, n, head_dim, generator=g, dtype=dtype), torch.randn(1, H, n, head_dim, generator=g, dtype=dtype))
                layer.finish_prefill(None)
                cache.pipeline.wait_all()
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
                    cache.pipeline.wait(0)  # the previous step's prefetched insert, outside the timed span
                    before = dict(cache.timer.seconds)
                    t0 = time.perf_counter()
                    kk, vv = cache.update(k1, k1.clone(), 0)
                    icecache_attention(module, q, kk, vv, None, scaling=scale)
                    wall = time.perf_counter() - t0
                    stages = {s_: cache.timer.seconds[s_] - before.get(s_, 0.0) for s_ in cache.timer.seconds}
                    if r >= 2:  # step 0 inserts synchronously (nothing prefetched yet); step 1 is a warm-up
                        rows.append({"wall": wall, **stages})
                cache.pipeline.wait_all()
                row = {"heads": H, "group": group, "head_dim": head_dim, "n": n, "budget": budget, "trace": traced, "steps": rows}
                if not traced:  # ---- the same steps with the insert done synchronously (what the worker job runs)
                    pager_s = [0.0]
                    for prow in layer.pagers:
                        for pg in prow:
                            def timed_insert(*a: Any, _f: Any = pg.insert, **kw: Any) -> Any:
                                t0 = time.perf_counter()
                                try:
                                    return _f(*a, **kw)
                                finally:
                                    pager_s[0] += time.perf_counter() - t0
                            pg.insert = timed_insert
                    cache.prefetch_inserts = False
                    sync: list[dict[str, float]] = []
                    for r in range(reps + 1):
                        k1 = torch.randn(1, H, 1, head_dim, generator=g, dtype=dtype)
                        before, p0 = cache.timer.seconds["insert"], pager_s[0]
                        kk, vv = cache.update(k1, k1.clone(), 0)
                        icecache_attention(module, torch.randn(1, H * group, 1, head_dim, generator=g, dtype=dtype), kk, vv, None,
                                           scaling=scale)
                        if r:
                            sync.append({"insert": cache.timer.seconds["insert"] - before, "pager_insert": pager_s[0] - p0})
                    row["sync_inserts"] = sync
                out["layer"].append(row)
    return out


def measure_background_share(
    model: Any, pool: KeyPool, context: int, prefill_tokens: int, input_ids: Any, n_keys: int, page_size: int,
    reps: int, pager: str = "mdci", seed: int = 0,
) -> dict[str, Any]:
    """How much a background thread doing index work slows the caller's thread, per second of that work.

    Foregrounds: a one-token decode step at ``context`` (while the background inserts keys into a ``pager`` of
    ``n_keys`` keys, as the runtime's prefetch does) and a prefill of ``prefill_tokens`` (while the background
    builds indexes, as the prefill pipeline does). ``share = (foreground time with - without) / (background
    work done meanwhile, at its own undisturbed speed)``; loaded and alone rounds alternate, each round of
    ``loaded_calls`` foreground calls (``loaded_s``, ``alone_s``: wall seconds per round).
    """
    import threading

    import torch

    from icecache.indexes import make_pager

    def bg_insert() -> Callable[[], None]:
        pg = make_pager(pager, head_dim=pool.d, page_size=page_size, seed=seed)
        pg.build(pool.keys_for(n_keys))
        extra = pool.keys_for(min(4096, pool.keys.shape[0] - n_keys), offset=n_keys)
        it = iter(range(10**12))
        return lambda: pg.insert(extra[next(it) % extra.shape[0]][None])

    def bg_build() -> Callable[[], None]:
        keys = pool.keys_for(min(n_keys, 4096))
        return lambda: make_pager(pager, head_dim=pool.d, page_size=page_size, seed=seed).build(keys)

    cache = _filled_cache(model, context, seed)
    ids = torch.tensor([[7]])

    def decode() -> None:
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, position_ids=torch.tensor([[context]]),
                  cache_position=torch.tensor([context]), use_cache=True)
        cache.crop(context)

    def prefill() -> None:
        with torch.inference_mode():
            model(input_ids=input_ids[:, :prefill_tokens], use_cache=True)

    out: dict[str, Any] = {}
    for name, fg, make_bg, fg_reps in (("decode", decode, bg_insert, max(reps, 5) * 4), ("prefill", prefill, bg_build, max(reps // 2, 3))):
        job = make_bg()
        job_s = statistics.median(timeit(job, 15 if name == "decode" else 5, warmup=2))
        alone: list[float] = []
        loaded: list[float] = []
        done = [0]
        busy_windows: list[float] = []
        warm = timeit(fg, 2, warmup=0)  # warm-up, and the foreground's length
        # a loaded round runs the foreground at least ``batch`` times back to back and until the background has
        # completed two jobs (at most 20 batches), so that a job longer than one foreground still gets counted
        batch = max(1, math.ceil(3 * job_s / max(min(warm), 1e-6)))
        calls: list[int] = []
        for r in range(fg_reps):
            stop = threading.Event()
            done[0] = 0

            def loop() -> None:
                while not stop.is_set():
                    job()
                    done[0] += 1

            th = threading.Thread(target=loop, daemon=True)
            th.start()
            time.sleep(0.002)
            c0, t0, n = done[0], time.perf_counter(), 0
            while n < batch or (done[0] - c0 < 2 and n < 20 * batch):
                fg()
                n += 1
            t1, c1 = time.perf_counter(), done[0]
            stop.set()
            th.join()
            loaded.append(t1 - t0)
            calls.append(n)
            t0 = time.perf_counter()  # the same number of calls alone
            for _ in range(n):
                fg()
            alone.append(time.perf_counter() - t0)
            busy_windows.append((c1 - c0) * job_s)
        slow = sum(loaded) - sum(alone)
        work = sum(busy_windows)
        out[name] = {"job_s": job_s, "alone_s": alone, "loaded_s": loaded, "loaded_calls": calls,
                     "background_work_s": busy_windows, "share": slow / work if work > 0 else None, "pager": pager,
                     "n_keys": n_keys}
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
    from icecache.runtime.cache import IceCache
    from icecache.runtime.generate import icecache_attention

    methods = ["full", *pagers]
    rows = {(n, m): {"tokens": n, "method": m, "ttft_s": [], "tt2t_s": [], "index_build_s": []} for n in tokens for m in methods}
    kv_heads = int(model.config.num_key_value_heads)
    layers = int(model.config.num_hidden_layers)

    def run(n: int, m: str) -> tuple[float, float, float]:
        ids = input_ids[:, :n]
        clock = _StampStreamer()
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                  streamer=clock, pad_token_id=0)
        if m == "full":
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(**kw)
            return clock.t[1] - t0, clock.t[2] - t0, 0.0
        cfg = IceCacheConfig(index=m, budget=budget, page_size=page_size, threads=threads, seed=seed)
        with icecache_attention(model), IceCache(model.config, cfg) as cache:
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


# ---------------------------------------------------------------------------------------------- fitting
def _points(rows: list[dict[str, Any]], features: Sequence[str], statistic: str = "p25") -> tuple[np.ndarray, np.ndarray]:
    X = np.array([[float(r[f]) for f in features] for r in rows], dtype=float).reshape(len(rows), len(features))
    y = np.array([STATISTICS[statistic](r["seconds"]) for r in rows])
    return X, y


def fit_profile_predictors(samples: dict[str, Any], statistic: str = "p25") -> dict[str, Predictor]:
    """Fit every predictor the simulator uses from raw samples (see `icecache.sim.costs.MeasuredCosts`),
    each point summarised by ``statistic`` (`STATISTICS`)."""
    preds: dict[str, Predictor] = {}
    if statistic not in STATISTICS:
        raise ConfigError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")

    def fit(name: str, form: str, rows: list[dict[str, Any]], features: Sequence[str]) -> None:
        if rows:
            X, y = _points(rows, features, statistic)
            preds[name] = fit_predictor(name, form, features, X, y)

    fit("decode_step", "affine", samples.get("decode_step", []), ["context"])
    fit("attention", "affine", samples.get("attention", []), ["kv_tokens"])
    fit("sparse_attention", "affine", samples.get("sparse_attention", []), ["slots"])
    fit("store_sync", "affine", samples.get("store_sync", []), ["tokens"])
    fit("lm_head", "constant", samples.get("lm_head", []), [])
    fit("prefill", "quadratic", samples.get("prefill", []), ["tokens"])
    for r in samples.get("generate_step", [])[:1]:
        extra = STATISTICS[statistic](r["generate_s"]) - STATISTICS[statistic](r["forward_s"])
        preds["step_other"] = Predictor(name="step_other", form="constant", features=(), params=(max(extra, 0.0),), lo=(), hi=(),
                                        fit_mape=0.0, n_points=len(r["generate_s"]))
    _fit_prefill_pipeline(samples.get("prefill_pipeline", []), preds, statistic)
    if samples.get("runtime_layer"):
        _fit_runtime_layer(samples["runtime_layer"], preds, statistic)
    else:  # profiles measured before the runtime existed: page gathers of a synthetic store
        for comp in ("gather", "scatter"):
            fit(comp, "affine", samples.get(comp, []), ["bytes", "pages"])
        fit("copy", "affine", samples.get("copy", []), ["bytes"])
    for name, rows in samples.get("pagers", {}).items():
        fit(f"select/{name}", "pwpower", rows["select"], ["n", "budget", "page_size"])
        fit(f"build/{name}", "pwpower", rows["build"], ["n", "page_size"])
        fit(f"insert/{name}", "pwpower", rows["insert"], ["n"])
    for name, rows in samples.get("decode_index", {}).items():  # see `MeasuredCosts.select_job_s`
        fit(f"select_decode/{name}", "pwpower", rows, ["n"])
        fit(f"insert_decode/{name}", "pwpower", [dict(r, seconds=r["insert_seconds"]) for r in rows], ["n"])
        if rows and all(r.get("step_seconds") for r in rows):  # the whole decode step (profiles since 2026-11)
            fit(f"step_decode/{name}", "pwpower", [dict(r, seconds=r["step_seconds"]) for r in rows], ["n"])
    return preds


def _fit_prefill_pipeline(rows: list[dict[str, Any]], preds: dict[str, Predictor], statistic: str) -> None:
    """``prefill_generate`` (full attention's time to first token through ``generate`` vs prompt tokens) and
    ``prefill_inline/<pager>`` (the runtime's prefill minus full attention's at the same length, per prefill
    job: per sparse layer and KV head, vs the job's tokens ``n = tokens - sink - window``) from
    `measure_prefill_pipeline` rows. A point whose difference is not positive (noise) is left out."""
    stat = STATISTICS[statistic]
    full = {r["tokens"]: stat(r["ttft_s"]) for r in rows if r["method"] == "full" and r["ttft_s"]}
    if full:
        X = np.array([[float(n)] for n in sorted(full)])
        preds["prefill_generate"] = fit_predictor("prefill_generate", "quadratic", ["tokens"], X, np.array([full[n] for n in sorted(full)]))
    by_pager: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        n = r["tokens"]
        if r["method"] == "full" or n not in full or not r["ttft_s"]:
            continue
        extra = (stat(r["ttft_s"]) - full[n]) / (r["sparse_layers"] * r["kv_heads"])
        if extra > 0:
            by_pager.setdefault(r["method"], []).append((float(n - r["sink"] - r["window"]), extra))
    for pager, pts in by_pager.items():
        pts.sort()
        preds[f"prefill_inline/{pager}"] = fit_predictor(f"prefill_inline/{pager}", "pwpower", ["n"], np.array([[x] for x, _ in pts]),
                                                         np.array([y for _, y in pts]))


def _fit_runtime_layer(data: dict[str, Any], preds: dict[str, Predictor], statistic: str) -> None:
    """Loader, append and per-layer overhead predictors from `measure_runtime_layer` samples.

    Per call as the simulator asks (`icecache.sim.costs.MeasuredCosts`): gather per ``index_select`` (one per
    head with new tokens; features bytes and rows per call), copy (one per layer), scatter per operation
    (`SCATTER_OPS` per layer, features per operation), bookkeeping per layer (heads, selected tokens); append
    and overhead per layer (heads).
    """
    from icecache.sim.costs import SCATTER_OPS

    stat = STATISTICS[statistic]
    rows: dict[str, list[tuple[list[float], float]]] = {
        k: [] for k in ("gather", "copy", "scatter", "loader_other", "append", "overhead", "overhead_traced", "insert_store")}
    for r in data.get("loader", []):
        H, k, nbytes, sec = r["heads"], r["new_tokens"], float(r["bytes"]), r["seconds_by_stage"]
        if k > 0:
            rows["gather"].append(([nbytes / H, float(k)], stat(sec["gather"]) / H))
            rows["copy"].append(([nbytes], stat(sec["copy"])))
        rows["scatter"].append(([nbytes / SCATTER_OPS, H * k / SCATTER_OPS], stat(sec["scatter"]) / SCATTER_OPS))
        rows["loader_other"].append(([float(H), float(H * r["selected"])], stat(sec["other"])))
    for r in data.get("layer", []):
        steps = r["steps"]
        timed = [sum(v for k_, v in st.items() if k_ != "wall") for st in steps]
        untimed = ([float(r["heads"])], stat([st["wall"] - t for st, t in zip(steps, timed)]))
        if r.get("trace"):
            rows["overhead_traced"].append(untimed)
        else:
            append = stat([st["insert"] for st in steps])
            rows["append"].append(([float(r["heads"])], append))
            rows["overhead"].append(untimed)
            if r.get("sync_inserts"):  # the worker job beyond the pager inserts: host-store sync, moves
                rows["insert_store"].append(([float(r["heads"])], stat([x["insert"] - x["pager_insert"] for x in r["sync_inserts"]]) - append))
    feats = {"gather": ["bytes", "rows"], "copy": ["bytes"], "scatter": ["bytes", "rows"], "loader_other": ["heads", "tokens"],
             "append": ["heads"], "overhead": ["heads"], "overhead_traced": ["heads"], "insert_store": ["heads"]}
    for name, pts in rows.items():
        pts = [(x, y) for x, y in pts if y > 0]
        if pts:
            preds[name] = fit_predictor(name, "affine", feats[name], np.array([x for x, _ in pts]), np.array([y for _, y in pts]))


def background_meta(bg: dict[str, Any] | None) -> dict[str, float]:
    """``background_share`` (decode: prefetched inserts) and ``background_share_prefill`` (index builds) from
    `measure_background_share`, each clamped to [0, 1] (the raw values stay in the samples)."""
    out: dict[str, float] = {}
    for key, name in (("background_share", "decode"), ("background_share_prefill", "prefill")):
        v = (bg or {}).get(name, {}).get("share")
        if v is not None:
            out[key] = min(max(float(v), 0.0), 1.0)
    return out


def pool_efficiency(rows: list[dict[str, Any]], statistic: str = "p25") -> dict[str, float]:
    """``{threads: ceil(J/T) * t_single / makespan_T}`` from `measure_pool` rows (1.0 means ideal)."""
    import math

    stat = STATISTICS[statistic]
    single = next(stat(r["seconds"]) for r in rows if r["threads"] == 0)
    return {
        str(r["threads"]): min(1.0, math.ceil(r["jobs"] / r["threads"]) * single / stat(r["seconds"]))
        for r in rows
        if r["threads"] > 0
    }


# ---------------------------------------------------------------------------------------------- driver
COMPONENTS: dict[str, tuple[str, ...]] = {
    # component: the sample keys it owns
    "model": ("decode_step", "attention", "lm_head", "prefill", "generate_step"),
    "pagers": ("pagers",),
    "pool": ("pool", "background"),
    "loader": ("gather", "copy", "scatter", "runtime_layer", "sparse_attention", "store_sync"),
    "pipeline": ("prefill_pipeline",),
    "decode_index": ("decode_index",),
}


def _runs_of(p: CalibrationProfile) -> list[dict[str, Any]]:
    """The measurement runs a profile was made from (one for a profile without a ``runs`` record)."""
    return [dict(r) for r in p.meta.get("runs", [{"created": p.created, "components": sorted(COMPONENTS),
                                                  "loadavg_start": p.machine.get("loadavg_start"),
                                                  "loadavg_end": p.machine.get("loadavg_end")}])]


def merge_profiles(base: CalibrationProfile, new: CalibrationProfile, components: Sequence[str]) -> CalibrationProfile:
    """``base`` with the samples of ``components`` taken from ``new``; predictors refitted from the merged samples.

    Both must come from the same machine, library versions and model; ``meta["runs"]`` lists which run measured
    which component (with its time and load averages), so a profile assembled from several runs says so.
    """
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ConfigError(f"unknown calibration components {sorted(unknown)}; known: {sorted(COMPONENTS)}")
    for key in ("cpu_model", "cpu_count"):
        if base.machine.get(key) != new.machine.get(key):
            raise ConfigError(f"cannot merge profiles of different machines ({key}: {base.machine.get(key)} vs {new.machine.get(key)})")
    if base.versions != new.versions:
        raise ConfigError(f"cannot merge profiles measured with different library versions: {base.versions} vs {new.versions}")
    from icecache.sim.shapes import shape_from_dict

    shapes = [shape_from_dict(p.meta["shape"]) if "shape" in p.meta else None for p in (base, new)]
    if shapes[0] != shapes[1]:  # compared as shapes: a profile written before a field existed still merges
        raise ConfigError("cannot merge profiles of different models")
    samples = dict(base.samples)
    for c in components:
        for key in COMPONENTS[c]:  # a re-measured component replaces all of its old samples ...
            old = samples.pop(key, None)
            if key in new.samples:
                samples[key] = new.samples[key]
            if key in ("pagers", "decode_index") and old:  # ... except pagers not timed this time (the version check flags them)
                samples[key] = {**old, **new.samples.get(key, {})}
    stat = new.meta.get("statistic", "p25")
    meta = dict(base.meta)
    runs = [dict(r, components=[c for c in r["components"] if c not in components]) for r in _runs_of(base)]
    runs = [r for r in runs if r["components"]]
    runs += [dict(r, components=[c for c in r["components"] if c in components]) for r in _runs_of(new)]
    meta["runs"] = runs
    if "pool" in components:
        meta["pool_efficiency"] = new.meta.get("pool_efficiency", meta.get("pool_efficiency"))
        meta["pool_pager"] = new.meta.get("pool_pager")
        for key in ("background_share", "background_share_prefill"):
            meta.pop(key, None)
            if key in new.meta:
                meta[key] = new.meta[key]
    hashes = dict(base.pager_hashes)
    if "pagers" in components or "decode_index" in components:
        meta["pagers"] = sorted(set(base.meta.get("pagers", [])) | set(new.meta.get("pagers", [])))
        hashes.update(new.pager_hashes)
    return CalibrationProfile(
        machine=dict(base.machine), versions=dict(base.versions), pager_hashes=hashes, created=new.created,
        predictors=fit_profile_predictors(samples, stat), meta=meta, samples=samples,
    )


def run_calibration(
    settings: CalibrationSettings | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    model_name: str = "smollm2-135m-instruct",
    components: Sequence[str] = tuple(COMPONENTS),
    base: CalibrationProfile | None = None,
    out: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> CalibrationProfile:
    """Measure ``components`` (model, pagers, pool, loader) as ``settings`` say and return a `CalibrationProfile`
    (written to ``out`` when given). With ``base``, only ``components`` are re-measured and the rest is kept
    (`merge_profiles`).

    ``model``/``tokenizer`` default to `icecache.load_model()`; tests pass a tiny model (and no tokenizer).
    """
    import torch

    from icecache.indexes import available_pagers

    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise ConfigError(f"unknown calibration components {sorted(unknown)}; known: {sorted(COMPONENTS)}")
    s = settings or CalibrationSettings()
    t0 = time.perf_counter()
    info = machine_info()
    if model is None:
        from icecache.runtime.models import load_model

        model, tokenizer = load_model()
    model.eval()
    shape: ModelShape = shape_from_config(model.config, model_name)
    log(f"calibrating {', '.join(components)} on {info['cpu_model']} ({info['cpu_count']} CPUs, torch threads "
        f"{info['torch_threads']}, load average {info['loadavg_start']})")
    samples: dict[str, Any] = {}
    n_ids = max(s.qk_tokens, max(s.prefill_tokens), max(s.pipeline_tokens) if "pipeline" in components else 0,
                max(s.decode_sizes) + _default_sink_window() if "decode_index" in components else 0)
    if tokenizer is not None:
        ids = prompt_ids(tokenizer, n_ids)
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, n_ids), generator=torch.Generator().manual_seed(s.seed))
    if "model" in components:
        log("decode step vs context ...")
        samples["decode_step"] = measure_decode_step(model, s.contexts, s.reps, s.seed)
        log("attention vs KV tokens ...")
        samples["attention"] = measure_attention(model, s.attention_tokens, s.reps, s.seed)
        samples["lm_head"] = measure_lm_head(model, s.reps)
        log("prefill vs tokens ...")
        samples["prefill"] = measure_prefill(model, ids, s.prefill_tokens, s.reps)
        log("generate's per-step overhead ...")
        samples["generate_step"] = measure_generate_step(model, ids[:, : s.generate_prompt_tokens], s.generate_new_tokens, s.reps, s.seed)
    names: list[str] = []
    pool_name = None
    g, d = shape.group_size, shape.head_dim
    if "pagers" in components or "pool" in components or "decode_index" in components:
        if "pagers" in components or "pool" in components:  # decode_index runs the model itself
            log(f"capturing keys and queries ({s.qk_tokens} tokens) ...")
            cap: dict[str, float] = {}
            q, k = capture_qk(model, ids[:, : s.qk_tokens], cap)
            if "model" in components and s.qk_tokens > max(s.prefill_tokens):  # that capture is a prefill too
                samples["prefill"].append({"tokens": s.qk_tokens, "seconds": [cap["forward_s"]], "note": "the key/query capture run"})
            pool = KeyPool(q, k)
            g, d = pool.g, pool.d
        names = list(s.pagers) if s.pagers is not None else available_pagers()
        missing = [n for n in names if n not in available_pagers()]
        if missing:
            log(f"pagers not available, skipped: {missing}")
        names = [n for n in names if n in available_pagers()]
        if "mdci" not in available_pagers():
            log("note: pager 'mdci' is not registered yet; the icecache variants need --pager until it is calibrated")
        if "pagers" in components:
            samples["pagers"] = {}
            for name in names:
                log(f"pager {name} ...")
                samples["pagers"][name] = measure_pager(
                    name, pool, s.pager_sizes, s.page_sizes, s.budgets, s.reps, s.insert_reps, s.pager_time_limit_s, s.seed, log
                )
        if "decode_index" in components:
            page = 16 if 16 in s.page_sizes else s.page_sizes[0]
            samples["decode_index"] = {}
            for name in names:
                log(f"pager {name} inside the runtime's decode (budget {max(s.budgets)}, page {page}) ...")
                samples["decode_index"][name] = measure_decode_index(
                    model, ids, name, s.decode_sizes, s.decode_steps, max(s.budgets), page, s.decode_dense_layers, s.decode_rounds,
                    s.seed, log)
        pool_name = "mdci" if "mdci" in names else (names[0] if names else None)
        if "pool" in components and pool_name:
            log(f"thread pool ({pool_name}, {shape.kv_heads} heads) ...")
            samples["pool"] = measure_pool(pool_name, pool, shape.kv_heads, min(s.pool_size, pool.keys.shape[0] // 2),
                                           16 if 16 in s.page_sizes else s.page_sizes[0], max(s.budgets), s.pool_threads, s.reps, s.seed)
    if "pool" in components and pool_name:
        log("background share (foreground slowdown per second of background index work) ...")
        n_bg = min(s.pool_size, pool.keys.shape[0] // 2)
        samples["background"] = measure_background_share(
            model, pool, s.background_context, min(s.background_prefill_tokens, ids.shape[1]), ids, n_bg,
            16 if 16 in s.page_sizes else s.page_sizes[0], s.reps, pool_name, s.seed)
    if "loader" in components:
        log("runtime layer (bulk loader, window append, per-layer overhead) ...")
        samples["runtime_layer"] = measure_runtime_layer(
            sorted({1, shape.kv_heads}), shape.group_size, shape.head_dim, model.dtype, s.runtime_layer_n, max(s.budgets),
            16 if 16 in s.page_sizes else s.page_sizes[0], [k for k in s.runtime_new_tokens if k <= max(s.budgets)], s.reps * 2, s.seed)
        log("sparse attention kernel vs device slots ...")
        samples["sparse_attention"] = measure_sparse_attention(shape.q_heads, shape.kv_heads, shape.head_dim, s.sparse_slots, s.reps,
                                                               s.seed)
        log("host store writes of a prefill job vs tokens ...")
        samples["store_sync"] = measure_store_sync(shape.head_dim, model.dtype, s.store_sync_tokens,
                                                   16 if 16 in s.page_sizes else s.page_sizes[0], s.reps, s.seed)
    if "pipeline" in components:
        pipe_pagers = [p for p in (s.pagers if s.pagers is not None else ("mdci", "sequential")) if p in available_pagers()]
        log(f"real prefills: full vs the runtime's pipeline with {', '.join(pipe_pagers)} at {list(s.pipeline_tokens)} tokens ...")
        samples["prefill_pipeline"] = measure_prefill_pipeline(
            model, ids, s.pipeline_tokens, pipe_pagers, 16 if 16 in s.page_sizes else s.page_sizes[0], max(s.budgets), 1,
            s.pipeline_rounds, s.seed)
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    wall = time.perf_counter() - t0
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    profile = CalibrationProfile(
        machine=info,
        versions=software_versions(),
        pager_hashes=pager_code_hashes(names),
        created=created,
        predictors=fit_profile_predictors(samples, s.statistic),
        meta={
            "model": model_name,
            "shape": shape_to_dict(shape),
            "dtype_bytes": int(torch.tensor([], dtype=model.dtype).element_size()),
            "attn_implementation": model.config._attn_implementation,
            "queries_per_select": g,
            "head_dim": d,
            "pool_pager": pool_name,
            "pool_efficiency": pool_efficiency(samples["pool"], s.statistic) if "pool" in samples else {"1": 1.0},
            **background_meta(samples.get("background")),
            "pagers": names,
            "settings": asdict(s),
            "wall_s": wall,
            "statistic": s.statistic,
            "runs": [{"created": created, "components": list(components), "loadavg_start": info["loadavg_start"],
                      "loadavg_end": info["loadavg_end"], "wall_s": wall}],
            "notes": "shared 2-core machine: timings are noisy (see runs[].loadavg_*); points are interleaved "
                     "rounds after warm-up, each summarised by `statistic`; raw samples kept",
        },
        samples=samples,
    )
    if base is not None:
        profile = merge_profiles(base, profile, components)
    if out is not None:
        profile.save(out)
        log(f"wrote {out} ({wall:.0f} s)")
    return profile


def summarize_profile(profile: CalibrationProfile) -> str:
    """A short human-readable table of the fitted predictors."""
    lines = [f"profile {profile.created} on {profile.machine.get('cpu_model')} ({profile.machine.get('cpu_count')} CPUs)"]
    for name, p in sorted(profile.predictors.items()):
        rng = ", ".join(f"{f} {lo:g}..{hi:g}" for f, lo, hi in zip(p.features, p.lo, p.hi))
        if p.form == "pwpower":  # the curve at the knots, other features at their smallest measured value
            k = int(p.params[0])
            pts = ", ".join(f"{math.exp(a):.0f}:{p.formula([math.exp(a), *p.lo[1:]]) * 1e3:.3g}ms" for a in p.params[1 : 1 + k])
            exps = ", ".join(f"{f}^{e:.2f}" for f, e in zip(p.features[1:], p.params[1 + 2 * k :]))
            at = ", ".join(f"{f}={lo:g}" for f, lo in zip(p.features[1:], p.lo[1:]))
            params = f"n:t {pts}" + (f" at {at}; x {exps}" if exps else "")
        else:
            params = ", ".join(f"{v:.4g}" for v in p.params)
        lines.append(f"  {name:22s} {p.form:9s} [{params}]  fit MAPE {p.fit_mape * 100:5.1f}%  ({rng})")
    lines.append(f"  pool efficiency: {profile.meta.get('pool_efficiency')}")
    return "\n".join(lines)
