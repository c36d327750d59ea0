"""Timings of the pagers on this machine: alone, round robin over sizes (`measure_pager`), inside the runtime's
decode (`measure_decode_index`), on a thread pool (`measure_pool`), and how much their background work slows
the caller's thread (`measure_background_share`). `KeyPool` holds the real keys and queries they run on."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

from icecache.core.errors import ConfigError
from icecache.measure.components import classmethods_timed, decode_insert_attr, filled_cache, layer_inserts_timed
from icecache.measure.timing import interleaved, timeit

__all__ = ["KeyPool", "measure_pager", "measure_decode_index", "measure_pool", "measure_background_share"]


class KeyPool:
    """Real keys and queries for pager timing: head 0's group of successive layers, concatenated."""

    def __init__(self, q: Any, k: Any) -> None:
        import torch

        self.g = q.shape[1] // k.shape[1]
        self.keys = torch.cat([k[layer, 0] for layer in range(k.shape[0])])  # [L * n, d]
        self.queries = torch.cat([q[layer, : self.g] for layer in range(q.shape[0])], dim=1)  # [g, L * n, d]
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
    from icecache.runtime.attention import use_attention
    from icecache.runtime.cache import IceCache

    if steps < 1 or rounds < 1:
        raise ConfigError(f"decode index timing needs steps >= 1 and rounds >= 1, got {steps} and {rounds}")
    kw = {} if dense_layers is None else {"dense_layers": tuple(dense_layers)}
    # inserts on the decode thread, timed in the step
    cfg = IceCacheConfig(index=pager, budget=budget, page_size=page_size, seed=seed, inserts="inline", **kw)
    rows: dict[int, dict[str, Any]] = {}
    for n in [n for _ in range(rounds) for n in sorted(sizes)]:
        tokens = n + cfg.sink + cfg.window
        if tokens > input_ids.shape[1]:
            if n not in rows:
                log(f"  {pager}: decode index at n={n} needs {tokens} prompt tokens, {input_ids.shape[1]} given; skipped")
            rows[n] = {}
            continue
        acc = {"select": 0.0, "insert": 0.0, "selects": 0, "inserts": 0}

        def timed(fn: Callable[..., Any], what: str, acc: dict[str, float] = acc) -> Callable[..., Any]:
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
        with torch.inference_mode(), use_attention(model), IceCache(model.config, cfg) as cache:
            logits = model(input_ids[:, :tokens], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            cache.workers.wait_all()
            jobs = 0
            kinds: set[type] = set()
            for layer in cache.layers:
                for row in getattr(layer, "pagers", None) or []:
                    for pg in row:
                        pg.select_arrays = timed(pg.select_arrays, "select")
                        name = decode_insert_attr(pg)
                        setattr(pg, name, timed(getattr(pg, name), "insert"))
                        kinds.add(type(pg))
                        jobs += 1
            tok = logits[0, -1].argmax().view(1, 1)
            for step in range(steps + 2):
                a0 = dict(acc)
                t0 = time.perf_counter()
                with layer_selects_timed(kinds, acc), layer_inserts_timed(kinds, acc):
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


def layer_selects_timed(kinds: set[type], acc: dict[str, Any]) -> AbstractContextManager[None]:
    """While open, every one-call layer selection (a pager class's ``_select_layer`` behind
    `SemanticPager.select_layer_positions`, which serves all KV heads of a layer row without calling their
    ``select_arrays``) adds its seconds to ``acc["select"]`` and one select per pager it served to
    ``acc["selects"]``; the classes are restored on exit."""
    return classmethods_timed(kinds, "_select_layer", acc, "select", counts=lambda out: out is not None)


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

    cache = filled_cache(model, context, seed)
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
        for _ in range(fg_reps):
            stop = threading.Event()
            done[0] = 0

            def loop(stop: threading.Event = stop, job: Callable[[], Any] = job, done: list[int] = done) -> None:
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
