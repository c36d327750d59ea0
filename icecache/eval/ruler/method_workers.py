"""Answer one sample's methods side by side on worker processes that share its dense prefill
(``--method-workers N``).

A decode step of these small models is mostly single-threaded Python between torch ops too small to gain from
a second intra-op thread, so one sample's methods finish sooner side by side, a share of the cores each, than
one after another on every core. The driver computes each sample's prefill once (on all its threads) and moves
its tensors to shared memory; the workers map them instead of copying (torch's multiprocessing reductions). The
workers are started once per run and keep the model (its weights in shared memory too) and their compiled
kernels across samples.

Why spawned, not forked after the prefill: GNU OpenMP (torch's and numba's) cannot start a thread team in a
process forked after its parent used one (a forked worker with two intra-op threads hangs in its first parallel
op), numba refuses a fork once its OpenMP layer runs in the parent, and a worker forked per sample reloads
every numba kernel for every sample (measured: a first M-DCI build of 16 s instead of 6.5 s).

Worker ``i`` is pinned to its own share of the driver's CPUs and runs that many torch and numba threads, so the
runtime's thread policy (`IceCacheConfig.inserts` ``"auto"``) sees the cores it really has. Records are the same
as a one-process run's, up to timings (tests/test_ruler_runner.py).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

#: this process's model and tokenizer when it is a method worker (set by `_start_worker`)
_WORKER: dict[str, Any] = {}


def driver_cores() -> list[int]:
    """CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def core_share(cores: Sequence[int], workers: int, worker: int) -> list[int]:
    """Worker ``worker``'s CPUs: ``cores`` split in ``workers`` contiguous parts as even as possible; when
    workers outnumber cores, one core each, in turn."""
    if workers > len(cores):
        return [cores[worker % len(cores)]]
    base, extra = divmod(len(cores), workers)
    start = worker * base + min(worker, extra)
    return list(cores[start:start + base + (1 if worker < extra else 0)])


def _start_worker(model: Any, tokenizer: Any, cores: list[int], counter: Any, workers: int) -> None:
    """Pool initializer: keep the model, pin this worker to its share of ``cores``, as many torch/numba threads."""
    import torch

    with counter.get_lock():
        worker = counter.value
        counter.value += 1
    mine = core_share(cores, workers, worker)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    try:
        import numba

        numba.set_num_threads(min(len(mine), numba.config.NUMBA_NUM_THREADS))
    except ImportError:  # pragma: no cover - numba is a core dependency
        pass
    torch.set_num_threads(len(mine))  # after numba: launching its OpenMP layer resets the count torch reads
    _WORKER.update(model=model, tokenizer=tokenizer, threads=len(mine), prefill=None)


def _shared_prefill(prefill: Any) -> dict[str, Any]:
    """The picklable parts of a `harness.Prefill`, its tensors moved to shared memory (once; pickling then
    sends handles)."""
    import torch

    with torch.inference_mode():
        layers = [(layer.keys.share_memory_(), layer.values.share_memory_()) for layer in prefill.kv.layers]
        return {"id": time.perf_counter_ns(), "input_ids": prefill.input_ids.share_memory_(), "layers": layers,
                "last_logits": prefill.last_logits.share_memory_(),
                "obs_queries": {i: q.share_memory_() for i, q in prefill.obs_queries.items()}}


def _worker_prefill(shared: dict[str, Any]) -> Any:
    """The `harness.Prefill` of ``shared`` (rebuilt once per sample in this worker)."""
    from transformers import DynamicCache

    from icecache.eval.harness import Prefill

    held = _WORKER.get("prefill")
    if held is not None and held[0] == shared["id"]:
        return held[1]
    kv = DynamicCache()
    for i, (keys, values) in enumerate(shared["layers"]):
        kv.update(keys, values, i)
    prefill = Prefill(input_ids=shared["input_ids"], kv=kv, last_logits=shared["last_logits"],
                      obs_queries=shared["obs_queries"])
    _WORKER["prefill"] = (shared["id"], prefill)
    return prefill


def _answer(job: tuple) -> tuple[int, dict[str, Any]]:
    from icecache.eval.ruler.runner import answer_method

    position, spec, sample, shared, method, budget, ready = job
    prefill = _worker_prefill(shared)
    record = answer_method(_WORKER["model"], _WORKER["tokenizer"], spec, sample, prefill, method, budget,
                           _WORKER["threads"])
    record["done_after_seconds"] = time.perf_counter() - ready
    return position, record


class MethodWorkers:
    """``workers`` processes (spawned once) that answer ``(method, budget)`` rows of a sample from its prefill."""

    def __init__(self, model: Any, tokenizer: Any, workers: int) -> None:
        import torch.multiprocessing  # noqa: F401  (registers the shared-memory tensor reductions)

        context = multiprocessing.get_context("spawn")
        self.workers = workers
        self._pool = context.Pool(workers, initializer=_start_worker,
                                  initargs=(model, tokenizer, driver_cores(), context.Value("i", 0), workers))

    def answer(self, spec: Any, sample: Any, prefill: Any, pairs: Sequence[tuple[str, int | None]], ready: float,
               ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(position in pairs, method fields of the record)`` as each row finishes (rows are handed out
        in order, one at a time); ``done_after_seconds`` counts from ``ready`` (`time.perf_counter`, one clock for
        every process). A worker's exception is raised here."""
        shared = _shared_prefill(prefill)
        jobs = [(i, spec, sample, shared, method, budget, ready) for i, (method, budget) in enumerate(pairs)]
        yield from self._pool.imap_unordered(_answer, jobs, chunksize=1)

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> MethodWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
