"""RULER samples sharded over Ray actors (``icecache eval ruler --ray``, or whenever ``RAY_ADDRESS`` is set) or
over local worker processes (``--workers N``).

Each worker (Ray actor or process) loads the model once and answers whole samples (one prefill, every method);
the driver appends each finished sample's records to the same ``predictions.jsonl`` as a local run, so sharded
and local runs resume each other and give the same records (up to timings). Ray needs the ``ray`` extra
(``pip install 'icecache[ray]'``); without ``RAY_ADDRESS`` Ray starts locally on this machine.

Why processes on one machine: a decode step of these small models is mostly single-threaded Python (selection,
inserts, bookkeeping) between torch ops too small to gain from a second thread. On the 2-core VM, two processes
of one thread each finished about twice the records per minute of one process on two threads (SmolLM2 at 4k:
11.6 against ~5; ``experiments/ruler/README.md``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError


class SampleWorker:
    """Holds one model; answers ``(index, length, task, pairs)`` units (a Ray actor's body)."""

    def __init__(self, spec_dict: dict[str, Any], torch_threads: int) -> None:
        import torch

        from icecache.eval.ruler.runner import spec_from_dict
        from icecache.runtime.models import load_model

        torch.set_num_threads(torch_threads)
        try:
            import numba

            numba.set_num_threads(min(torch_threads, numba.config.NUMBA_NUM_THREADS))
        except ImportError:  # pragma: no cover - numba is a core dependency
            pass
        from icecache.eval.harness import check_fits_context

        self.spec = spec_from_dict(spec_dict)
        self.model, self.tokenizer = load_model(self.spec.model)
        check_fits_context(self.model, self.spec.lengths)

    def run(self, index: int, length: int, task: str, pairs: list) -> list[dict[str, Any]]:
        from icecache.eval.ruler.runner import run_sample

        return run_sample(self.model, self.tokenizer, self.spec, index, length, task, [tuple(p) for p in pairs])


#: this process's `SampleWorker` when it is one of `run_on_processes`'s workers (set by `_start_process_worker`)
_PROCESS_WORKER: SampleWorker | None = None


def _start_process_worker(spec_dict: dict[str, Any], torch_threads: int) -> None:
    global _PROCESS_WORKER
    _PROCESS_WORKER = SampleWorker(spec_dict, torch_threads)


def _process_run(unit: tuple) -> list[dict[str, Any]]:
    assert _PROCESS_WORKER is not None, "not a run_on_processes worker"
    return _PROCESS_WORKER.run(*unit)


def run_on_processes(spec: Any, out_dir: str | Path, workers: int, *, progress: bool = True) -> list[dict[str, Any]]:
    """Run the pending samples of ``spec`` on ``workers`` local processes (spawned; each loads the model once and
    uses ``cpu_count // workers`` torch threads, at least one); returns every record of the run."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from tqdm.auto import tqdm

    from icecache.eval.ruler.runner import PredictionLog, pending_units, spec_to_dict

    log = PredictionLog(out_dir, spec.signature())
    todo = pending_units(spec, log.done)
    if not todo:
        return log.records
    count = max(1, min(workers, len(todo)))
    threads = max(1, (os.cpu_count() or 1) // count)
    bar = tqdm(total=sum(len(p) for *_, p in todo), desc=f"ruler {spec.model} (processes x{count})", unit="run",
               disable=not progress)
    pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_process_worker, initargs=(spec_to_dict(spec), threads))
    try:
        queue = list(todo)
        running = {pool.submit(_process_run, queue.pop(0)) for _ in range(min(count, len(queue)))}
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                for record in future.result():
                    log.append(record)
                    bar.update(1)
                if queue:
                    running.add(pool.submit(_process_run, queue.pop(0)))
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
    return log.records


def run_on_ray(spec: Any, out_dir: str | Path, *, progress: bool = True, workers: int | None = None) -> list[dict[str, Any]]:
    """Run the pending samples of ``spec`` on Ray actors; returns every record of the run."""
    try:
        import ray
    except ImportError:
        why = ("RAY_ADDRESS is set, which sends the run to Ray; unset it to run here" if os.environ.get("RAY_ADDRESS")
               else "--ray shards the samples on Ray")
        raise ConfigError(f"Ray is not installed: pip install 'icecache[ray]' ({why})") from None
    from tqdm.auto import tqdm

    from icecache.eval.ruler.runner import PredictionLog, pending_units, spec_to_dict

    log = PredictionLog(out_dir, spec.signature())
    todo = pending_units(spec, log.done)
    if not todo:
        return log.records
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
    try:
        cpus = int(ray.available_resources().get("CPU", 1))
        count = max(1, min(workers or cpus, len(todo)))
        threads = max(1, cpus // count)
        actor = ray.remote(num_cpus=threads)(SampleWorker)
        pool = [actor.remote(spec_to_dict(spec), threads) for _ in range(count)]
        bar = tqdm(total=sum(len(p) for *_, p in todo), desc=f"ruler {spec.model} (ray x{count})", unit="run",
                   disable=not progress)
        queue = list(todo)
        running: dict[Any, Any] = {}
        for worker in pool:
            if queue:
                running[worker.run.remote(*queue.pop(0))] = worker
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            worker = running.pop(done[0])
            for record in ray.get(done[0]):
                log.append(record)
                bar.update(1)
            if queue:
                running[worker.run.remote(*queue.pop(0))] = worker
        bar.close()
    finally:
        if started_here:
            ray.shutdown()
    return log.records
