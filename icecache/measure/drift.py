"""The machine's speed drift during a long measurement, and runs rescaled to one common speed.

A shared VM's speed wanders by 10-40% over the hour a calibration and its validation runs take (the
nineteenth and twenty-first sessions' attempts, `experiments/sim/README.md`). A *speed probe*, one fixed short
workload timed just before each run, follows that drift; dividing each run's timings by its probe's ratio to
the session's median probe puts all runs at one speed. The raw timings are always kept beside the rescaled ones.

The probe has two numbers, because prefill (matrix products on every thread) and decode (small, latency-bound
steps) drift differently: ``ttft_s`` (its prompt's prefill) and ``tpot_s`` (its decode step).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SpeedProbe", "measure_probe", "drift_factors", "rescaled_run"]

#: The probe's workload: full attention (the model's own), a prompt of this many tokens, this many decode steps.
PROBE_CONTEXT = 1024
PROBE_STEPS = 16


@dataclass(frozen=True)
class SpeedProbe:
    """One probe: prefill seconds of its prompt and seconds per decode step."""

    ttft_s: float
    tpot_s: float

    def to_dict(self) -> dict[str, float]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


def measure_probe(model: Any, tokenizer: Any, prompt: str, threads: int = 2) -> SpeedProbe:
    """Time the probe workload once: ``prompt`` (about `PROBE_CONTEXT` tokens) under full attention on
    ``threads`` torch threads, `PROBE_STEPS` new tokens."""
    import torch

    from icecache.runtime.generate import generate  # lazy: no work at import time

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        res = generate(model, tokenizer, prompt, config=None, max_new_tokens=PROBE_STEPS, min_new_tokens=PROBE_STEPS,
                       chat=True, return_result=True)
    finally:
        torch.set_num_threads(before)
    return SpeedProbe(float(res.ttft_seconds), float(res.tpot_seconds))


def drift_factors(probes: Sequence[SpeedProbe]) -> list[tuple[float, float]]:
    """Per probe, ``(prefill factor, decode factor)``: the session's median probe divided by this probe, so
    that a run measured on a machine 10% slower than usual (probe 1.1x the median) is multiplied by 1/1.1."""
    if not probes:
        return []
    mid_ttft = statistics.median(p.ttft_s for p in probes)
    mid_tpot = statistics.median(p.tpot_s for p in probes)
    return [(mid_ttft / p.ttft_s, mid_tpot / p.tpot_s) for p in probes]


def rescaled_run(run: dict[str, Any], prefill_factor: float, decode_factor: float) -> dict[str, Any]:
    """``run`` (a measured run's row: ``tpot_s``, ``tt2t_s``, ``ttft_s``, per-step ``stage_seconds``) at the
    common speed: TTFT times ``prefill_factor``; TPOT and every decode stage times ``decode_factor``; TT2T, a
    prefill and one decode step, as its two parts. Other fields are copied; the raw timings stay under
    ``raw_timings``."""
    out = dict(run)
    ttft, tt2t = float(run["ttft_s"]), float(run["tt2t_s"])
    out["ttft_s"] = ttft * prefill_factor
    out["tt2t_s"] = ttft * prefill_factor + max(tt2t - ttft, 0.0) * decode_factor
    out["tpot_s"] = float(run["tpot_s"]) * decode_factor
    out["stage_seconds"] = {k: float(v) * decode_factor for k, v in (run.get("stage_seconds") or {}).items()}
    out["raw_timings"] = {k: run[k] for k in ("tpot_s", "tt2t_s", "ttft_s", "stage_seconds") if k in run}
    out["drift_factors"] = [prefill_factor, decode_factor]
    return out
