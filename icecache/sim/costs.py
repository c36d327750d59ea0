"""The cost-model interface: the one way the simulator's plans ask for stage times (`CostModel`).

`CostModel` (an ABC) answers every stage time of a decode step and a prefill in seconds, pure: no I/O, no
clock, no global state. `icecache.sim.cost_models` has the two implementations (`MeasuredCosts`: a calibration
profile's machine; `GpuCosts`: a GPU server's constants with a measured host); `CostModelWrapper` delegates
every answer to another model (subclass it to change one answer, as `icecache.sim.crossover.SelectGrowth` does).
Units: seconds (``_s``), bytes, bytes per second (``_Bps``), tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from icecache.core.config import inserts_in_background
from icecache.sim.shapes import ModelShape

__all__ = ["Notes", "RING_WRITES", "SCATTER_OPS", "CostModel", "CostModelWrapper"]

Notes = list[str] | None

#: Device writes of the window ring per sparse layer and step in the runtime (`IceCacheLayer._decode_append`:
#: K, V and the validity mask).
RING_WRITES = 3
#: Scatter operations per sparse layer and step in the runtime (`BulkLoader.load`: ``index_copy_`` of K and of
#: V, and the validity-mask write, which happens even when nothing was copied).
SCATTER_OPS = 3


class CostModel(ABC):
    """Stage times of one machine, as the simulator's plans ask for them (seconds; ``notes`` collects what was
    extrapolated, scaled or not measured).

    ``shape`` is the simulated model's `ModelShape`; ``pager`` the pager whose costs stand for the index; ``n``
    the indexed tokens per KV head. Every method is pure.
    """

    # -- the machine
    @property
    @abstractmethod
    def host_threads(self) -> int:
        """CPU threads of the host's worker pool."""

    @property
    @abstractmethod
    def device_memory_bytes(self) -> float | None:
        """Device memory (None: no separate device, nothing to overflow)."""

    @property
    @abstractmethod
    def kv_dtype_bytes(self) -> int:
        """Bytes per KV element when the configuration does not set them."""

    @property
    @abstractmethod
    def shared(self) -> bool:
        """One machine runs everything: the device, the links and the pool share its CPU (a CPU-only machine)."""

    @property
    def free_cores(self) -> int:
        """CPU cores the model's own threads leave free on a shared machine (0 unless measured)."""
        return 0

    def background_inserts(self, mode: str) -> bool:
        """Whether the runtime's decode inserts run on a worker thread here, as `IceCacheConfig.inserts` decides
        (the runtime's insert-worker rule): ``"background"`` / ``"inline"`` as given; ``"auto"``:
        background off a shared machine (the KV is on an accelerator) or when the model leaves a core free."""
        return inserts_in_background(mode, not self.shared, self.free_cores)

    # -- device work
    @abstractmethod
    def layer_compute_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Non-attention work of one decode layer (norms, projections, MLP, framework overhead)."""

    @abstractmethod
    def attend_s(self, shape: ModelShape, tokens: int, *, in_model: bool, notes: Notes = None) -> float:
        """Attention of one layer over ``tokens`` keys: through the model's own cache (``in_model``) or over a
        sparse layer's device buffer."""

    @abstractmethod
    def head_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Final norm and LM head, once per step."""

    @abstractmethod
    def step_other_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """Per-step host work beyond the model's forward."""

    @abstractmethod
    def prefill_layer_s(self, shape: ModelShape, tokens: int, notes: Notes = None, window: int | None = None) -> float:
        """Prefill of one layer over ``tokens`` prompt tokens (``window``: a sliding layer's window)."""

    def prefill_inline_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float | None:
        """One prefill job as measured inside a real prefill on a shared machine; None (the default) composes the
        prefill from isolated job times (`build_job_s`)."""
        return None

    # -- host index work
    @abstractmethod
    def select_job_s(self, shape: ModelShape, pager: str, n: int, budget: int, page_size: int, notes: Notes = None) -> float:
        """One KV head's index query (its GQA group's queries) over ``n`` indexed tokens."""

    @abstractmethod
    def build_job_s(self, shape: ModelShape, pager: str, n: int, page_size: int, notes: Notes = None) -> float:
        """One KV head's prefill job (index build and host-store writes) over ``n`` tokens."""

    @abstractmethod
    def insert_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float:
        """Insertion of one token into one KV head's index of ``n`` tokens."""

    @abstractmethod
    def append_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """The synchronous window insert of one sparse layer and step."""

    @abstractmethod
    def insert_store_s(self, shape: ModelShape, notes: Notes = None) -> float:
        """The insert job's work per sparse layer beyond the pager inserts (page-table moves, host-store sync)."""

    @abstractmethod
    def overhead_s(self, shape: ModelShape, notes: Notes = None, traced: bool = False) -> float:
        """The runtime's untimed host work per sparse layer and step (``traced``: with a selection trace)."""

    @abstractmethod
    def loader_other_s(self, heads: int, tokens: float, notes: Notes = None) -> float:
        """The bulk loader's bookkeeping for one layer (``heads`` KV heads, ``tokens`` selected tokens in all)."""

    @abstractmethod
    def background_share(self, notes: Notes = None, phase: str = "decode") -> float:
        """Fraction of background pool work that holds a shared machine (``phase``: decode or prefill)."""

    @abstractmethod
    def pool_efficiency(self, threads: int, notes: Notes = None) -> float:
        """Parallel efficiency of ``threads`` pool threads (job time is divided by it)."""

    # -- transfers
    @abstractmethod
    def gather_s(self, nbytes: float, rows: float, calls: int, notes: Notes = None) -> float:
        """Gather of ``rows`` rows (``nbytes``) from the host store into staging, in ``calls`` calls."""

    @abstractmethod
    def copy_h2d_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        """Host-to-device copy of ``nbytes`` in ``calls`` transfers."""

    @abstractmethod
    def copy_d2h_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        """Device-to-host copy (offload) of ``nbytes`` in ``calls`` transfers."""

    @abstractmethod
    def scatter_s(self, nbytes: float, rows: float, calls: int, notes: Notes = None) -> float:
        """Scatter of staged rows into their device slots in ``calls`` operations."""


@dataclass(frozen=True)
class CostModelWrapper(CostModel):
    """A cost model that answers everything as ``base`` does; subclasses override what they change."""

    base: CostModel

    @property
    def host_threads(self) -> int:
        return self.base.host_threads

    @property
    def device_memory_bytes(self) -> float | None:
        return self.base.device_memory_bytes

    @property
    def kv_dtype_bytes(self) -> int:
        return self.base.kv_dtype_bytes

    @property
    def shared(self) -> bool:
        return self.base.shared

    @property
    def free_cores(self) -> int:
        return self.base.free_cores

    def layer_compute_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return self.base.layer_compute_s(shape, notes)

    def attend_s(self, shape: ModelShape, tokens: int, *, in_model: bool, notes: Notes = None) -> float:
        return self.base.attend_s(shape, tokens, in_model=in_model, notes=notes)

    def head_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return self.base.head_s(shape, notes)

    def step_other_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return self.base.step_other_s(shape, notes)

    def prefill_layer_s(self, shape: ModelShape, tokens: int, notes: Notes = None, window: int | None = None) -> float:
        return self.base.prefill_layer_s(shape, tokens, notes, window)

    def prefill_inline_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float | None:
        return self.base.prefill_inline_job_s(shape, pager, n, notes)

    def select_job_s(self, shape: ModelShape, pager: str, n: int, budget: int, page_size: int, notes: Notes = None) -> float:
        return self.base.select_job_s(shape, pager, n, budget, page_size, notes)

    def build_job_s(self, shape: ModelShape, pager: str, n: int, page_size: int, notes: Notes = None) -> float:
        return self.base.build_job_s(shape, pager, n, page_size, notes)

    def insert_job_s(self, shape: ModelShape, pager: str, n: int, notes: Notes = None) -> float:
        return self.base.insert_job_s(shape, pager, n, notes)

    def append_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return self.base.append_s(shape, notes)

    def insert_store_s(self, shape: ModelShape, notes: Notes = None) -> float:
        return self.base.insert_store_s(shape, notes)

    def overhead_s(self, shape: ModelShape, notes: Notes = None, traced: bool = False) -> float:
        return self.base.overhead_s(shape, notes, traced)

    def loader_other_s(self, heads: int, tokens: float, notes: Notes = None) -> float:
        return self.base.loader_other_s(heads, tokens, notes)

    def background_share(self, notes: Notes = None, phase: str = "decode") -> float:
        return self.base.background_share(notes, phase)

    def pool_efficiency(self, threads: int, notes: Notes = None) -> float:
        return self.base.pool_efficiency(threads, notes)

    def gather_s(self, nbytes: float, rows: float, calls: int, notes: Notes = None) -> float:
        return self.base.gather_s(nbytes, rows, calls, notes)

    def copy_h2d_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        return self.base.copy_h2d_s(nbytes, calls, notes)

    def copy_d2h_s(self, nbytes: float, calls: int, notes: Notes = None) -> float:
        return self.base.copy_d2h_s(nbytes, calls, notes)

    def scatter_s(self, nbytes: float, rows: float, calls: int, notes: Notes = None) -> float:
        return self.base.scatter_s(nbytes, rows, calls, notes)
