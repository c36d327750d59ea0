"""The SimPy engine: one machine's resources and the processes of prefill and decode (see `icecache.sim.model`
for what is modelled).

Resources are the device (one compute stream), the host->device and device->host links (one copy engine
each), and the host CPU thread pool; on a shared machine (a CPU-only one) they are one resource. The *coarse*
engine gives a pool stage of J jobs on T threads the makespan ``ceil(J/T) * t`` from a `simpy.Container`; the
*fine* one runs every job as its own process on a `simpy.Resource` of T threads (the test oracle).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import simpy

from icecache.sim.plans import LayerPlan, PrefillLayer, PrefillPlan, StepPlan

__all__ = ["STAGES", "Machine", "StepResult", "simulate_step", "RequestResult", "simulate_request"]

#: Stages, in the runtime's names where the runtime times the same thing (its ``timing.STAGES``):
#: select, gather, copy, scatter, attend (sparse layers' attention over their device buffer), insert (the
#: synchronous part of the window insert), other (the bulk loader's bookkeeping and per-step host overhead).
#: Not timed by the runtime: dense_attend (attention through the model's own cache: dense, sliding and every
#: layer of ``full``), compute (projections, MLP, norms, LM head), overhead (untimed host work: per sparse
#: layer the runtime's entry points, accounting and prefetch submission; per step `transformers`' generate
#: loop) and prefetch (background inserts, pool work).
STAGES: tuple[str, ...] = ("select", "gather", "copy", "scatter", "attend", "dense_attend", "compute", "insert", "prefetch",
                           "overhead", "other")


class Machine:
    """The resources of one simulated machine and the stage primitives (generator methods)."""

    def __init__(self, env: simpy.Environment, threads: int, efficiency: float, shared: bool, fine: bool,
                 background_share: float = 1.0) -> None:
        self.env = env
        self.threads = max(1, threads)
        self.efficiency = efficiency
        self.shared = shared
        self.fine = fine
        self.background_share = min(max(background_share, 0.0), 1.0)
        self.busy: dict[str, float] = defaultdict(float)
        #: wall seconds from asking for a resource to releasing it, per stage: what a stage timer wrapped around
        #: the caller's code reads (it includes waiting for a CPU held by background work)
        self.timed: dict[str, float] = defaultdict(float)
        if shared:
            cpu = simpy.Resource(env, capacity=1)
            self.device = self.h2d = self.d2h = self.cpu = cpu
        else:
            self.device = simpy.Resource(env, capacity=1)
            self.h2d = simpy.Resource(env, capacity=1)
            self.d2h = simpy.Resource(env, capacity=1)
            self.cpu = None
            if fine:
                self.slots = simpy.Resource(env, capacity=self.threads)
            else:
                self.pool = simpy.Container(env, capacity=self.threads, init=self.threads)

    def hold(self, res: simpy.Resource, seconds: float, stage: str) -> Generator:
        """Hold ``res`` for ``seconds`` (FIFO) and book the time to ``stage``."""
        if seconds <= 0:
            return
        t0 = self.env.now
        with res.request() as req:
            yield req
            yield self.env.timeout(seconds)
        self.busy[stage] += seconds
        self.timed[stage] += self.env.now - t0

    def _job(self, seconds: float) -> Generator:
        with self.slots.request() as req:
            yield req
            yield self.env.timeout(seconds)

    def pool_stage(self, jobs: int, job_s: float, stage: str, scaled: bool = True, background: bool = False) -> Generator:
        """``jobs`` identical jobs of ``job_s`` on the thread pool (divided by the pool efficiency when ``scaled``).

        ``background``: work that runs beside the caller's thread; on a shared machine it holds the one CPU
        resource for ``background_share`` of its makespan and runs the rest without it."""
        if jobs <= 0 or job_s <= 0:
            return
        t = job_s / self.efficiency if scaled else job_s
        makespan = math.ceil(jobs / self.threads) * t
        start = self.env.now
        if self.shared:
            held = makespan * (self.background_share if background else 1.0)
            yield from self.hold(self.cpu, held, stage)
            if makespan > held:
                yield self.env.timeout(makespan - held)
                self.busy[stage] += makespan - held
                self.timed[stage] += makespan - held
        elif self.fine:
            yield self.env.all_of([self.env.process(self._job(t)) for _ in range(jobs)])
            self.busy[stage] += self.env.now - start
            self.timed[stage] += self.env.now - start
        else:
            k = min(jobs, self.threads)
            yield self.pool.get(k)
            yield self.env.timeout(makespan)
            yield self.pool.put(k)
            self.busy[stage] += makespan
            self.timed[stage] += self.env.now - start

    def host(self, seconds: float, stage: str) -> Generator:
        """Work on the caller's thread (Python, index queries of the runtime, bookkeeping)."""
        if self.shared:
            yield from self.hold(self.cpu, seconds, stage)
        elif seconds > 0:
            yield self.env.timeout(seconds)
            self.busy[stage] += seconds
            self.timed[stage] += seconds

    # -- processes
    def load(self, lp: LayerPlan, ready: simpy.Event | None = None, caller: bool = False) -> Generator:
        """Bulk load of one layer's new pages: bookkeeping -> gather -> one copy -> scatter.

        ``caller``: the gather runs on the caller's thread (the runtime) instead of one pool thread (paper).
        ``ready``: the layer's KV is on the host (its offload finished), when a prefill is still running."""
        if ready is not None:
            yield ready
        yield from self.host(lp.other_s, "other")
        if caller:
            yield from self.host(lp.gather_s, "gather")
        else:
            yield from self.pool_stage(1, lp.gather_s, "gather", scaled=False)
        yield from self.hold(self.h2d, lp.copy_s, "copy")
        yield from self.hold(self.device, lp.scatter_s, "scatter")

    def _background_insert(self, lp: LayerPlan) -> Generator:
        # the runtime submits one pool job per layer that inserts into every (row, KV head) one after another
        yield from self.pool_stage(1, lp.insert_jobs * lp.insert_job_s + lp.insert_store_s, "prefetch", scaled=False, background=True)

    def decode(
        self, plan: StepPlan, index_ready: Sequence[simpy.Event] | None = None,
        pending: dict[int, simpy.Process] | None = None, first: bool = False,
    ) -> Generator:
        """One decode step (all layers, LM head, per-step host work).

        ``index_ready[l]``: layer l's offload (and index build) is done; given when the step follows a prefill
        whose background work may still run. ``pending``: the previous step's background inserts per layer
        (waited for when the layer is reached; replaced by this step's). ``first``: the first step after
        prefill, whose inserts are synchronous (runtime)."""
        own = (lambda m: index_ready[m]) if index_ready is not None else (lambda m: None)
        runtime = plan.impl == "runtime"
        loads: dict[int, simpy.Process] = {}
        for layer, lp in enumerate(plan.layers):
            yield from self.hold(self.device, lp.compute_s, "compute")
            if lp.kind != "sparse":
                yield from self.hold(self.device, lp.attend_s, "dense_attend")
                continue
            if runtime:
                if pending is not None and layer in pending:
                    yield pending.pop(layer)  # `pipeline.wait(layer)` in `_decode_append`
                if index_ready is not None:
                    yield index_ready[layer]  # the same wait covers the layer's prefill jobs
                # inline inserts (and the first step's) insert the token leaving now, when the layer is reached
                inline = first or pending is None or plan.inline_inserts
                sync = lp.insert_jobs * lp.insert_job_s + lp.insert_store_s if inline else 0.0
                yield from self.host(lp.append_s + sync, "insert")
                yield from self.host(lp.overhead_s, "overhead")
                if lp.selects:
                    yield from self.host(lp.select_jobs * lp.select_job_s, "select")
                loads[layer] = self.env.process(self.load(lp, None, caller=True))
                yield loads[layer]
                if pending is not None and lp.insert_jobs and not plan.inline_inserts:  # `_prefetch_insert`
                    pending[layer] = self.env.process(self._background_insert(lp))
                    if self.shared:  # the worker starts at once and takes the CPU (the GIL) before attention
                        yield self.env.timeout(0)
                yield from self.hold(self.device, lp.attend_s, "attend")
                continue
            if lp.selects:
                if index_ready is not None:
                    yield index_ready[layer]
                yield from self.pool_stage(lp.insert_jobs, lp.insert_job_s, "insert")
                yield from self.pool_stage(lp.select_jobs, lp.select_job_s, "select")
                members = plan.groups.get(layer, (layer,)) if plan.prefetch else (layer,)
                for m in members:
                    if m not in loads:
                        loads[m] = self.env.process(self.load(plan.layers[m], own(m)))
            if layer not in loads:
                loads[layer] = self.env.process(self.load(lp, own(layer)))
            yield loads[layer]
            yield from self.hold(self.device, lp.attend_s, "attend")
        yield from self.hold(self.device, plan.head_s, "compute")
        # per-step host work: generate's loop (runtime: untimed overhead); the paper's breakdown calls it "other"
        yield from self.host(plan.other_s, "overhead" if runtime else "other")

    def _post(self, pl: PrefillLayer, ready: simpy.Event) -> Generator:
        yield from self.hold(self.d2h, pl.offload_s, "offload")
        yield from self.pool_stage(pl.build_jobs, pl.build_job_s, "build", background=True)
        ready.succeed()

    def prefill(
        self, plan: PrefillPlan, index_ready: Sequence[simpy.Event], first_token: simpy.Event, marks: dict[str, float]
    ) -> Generator:
        """Prefill: device compute per layer; each layer's offload and index build start behind it."""
        posts = []
        for layer, pl in enumerate(plan.layers):
            yield from self.hold(self.device, pl.compute_s, "prefill")
            yield from self.hold(self.device, pl.inline_s, "build")
            posts.append(self.env.process(self._post(pl, index_ready[layer])))
        yield from self.hold(self.device, plan.head_s, "prefill")
        marks["ttft"] = self.env.now
        first_token.succeed()
        yield self.env.all_of(posts)
        marks["prefill_end"] = self.env.now


@dataclass(frozen=True)
class StepResult:
    """Simulated decode step: its duration and the busy seconds of every stage."""

    seconds: float
    busy: dict[str, float]
    timed: dict[str, float] = field(default_factory=dict)


def simulate_step(plan: StepPlan, fine: bool = False) -> StepResult:
    """Run one steady-state decode step of ``plan`` on an otherwise idle machine.

    With background inserts (runtime) two consecutive steps run, the second waiting for the first one's
    inserts, and the second is reported (its duration; busy seconds are the mean of the two steps)."""
    env = simpy.Environment()
    m = Machine(env, plan.threads, plan.efficiency, plan.shared, fine, plan.background_share)
    steps = 2 if plan.has_background else 1
    ends: list[float] = []

    def run() -> Generator:
        pending: dict[int, simpy.Process] | None = {} if plan.impl == "runtime" else None
        for _ in range(steps):
            yield from m.decode(plan, pending=pending)
            ends.append(env.now)

    env.process(run())
    env.run()
    seconds = ends[-1] - (ends[-2] if len(ends) > 1 else 0.0)
    return StepResult(seconds, {s: m.busy.get(s, 0.0) / steps for s in STAGES}, {s: m.timed.get(s, 0.0) / steps for s in STAGES})


@dataclass(frozen=True)
class RequestResult:
    """Prefill, then the first decode step (waiting for the indexes it needs)."""

    ttft_s: float
    prefill_end_s: float
    tt2t_s: float
    busy: dict[str, float]


def simulate_request(prefill: PrefillPlan, step: StepPlan, fine: bool = False) -> RequestResult:
    """Prefill pipeline followed by the first decode step, on one machine (TTFT, end of index builds, TT2T)."""
    env = simpy.Environment()
    m = Machine(env, prefill.threads, prefill.efficiency, prefill.shared, fine, prefill.background_share)
    ready = [env.event() for _ in prefill.layers]
    marks: dict[str, float] = {}

    first_token = env.event()

    def request() -> Generator:
        p = env.process(m.prefill(prefill, ready, first_token, marks))
        yield first_token
        pending: dict[int, simpy.Process] | None = {} if step.impl == "runtime" else None
        yield from m.decode(step, ready, pending=pending, first=True)
        marks["tt2t"] = env.now
        yield p

    env.process(request())
    env.run()
    return RequestResult(marks["ttft"], marks["prefill_end"], marks["tt2t"], dict(m.busy))
