"""RULER samples sharded over Ray (``icecache eval ruler --ray``, or whenever ``RAY_ADDRESS`` is set).

Each Ray actor loads the model once and answers whole samples (one prefill, every method); the driver
appends each finished sample's records to the same ``predictions.jsonl`` as a local run, so a Ray run and a
local run resume each other and give the same records (up to timings). Needs the ``ray`` extra
(``pip install 'icecache[ray]'``); without ``RAY_ADDRESS`` Ray starts locally on this machine.
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
        self.spec = spec_from_dict(spec_dict)
        self.model, self.tokenizer = load_model(self.spec.model)

    def run(self, index: int, length: int, task: str, pairs: list) -> list[dict[str, Any]]:
        from icecache.eval.ruler.runner import run_sample

        return run_sample(self.model, self.tokenizer, self.spec, index, length, task, [tuple(p) for p in pairs])


def run_on_ray(spec: Any, out_dir: str | Path, *, progress: bool = True, workers: int | None = None) -> list[dict[str, Any]]:
    """Run the pending samples of ``spec`` on Ray actors; returns every record of the run."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'icecache[ray]'") from None
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
