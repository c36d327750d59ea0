"""The native kernel library, loaded with ctypes (which releases the GIL for every call).

    kernels = native_kernels()          # NativeKernels, or None: the numba kernels run (see `kernel_status`)
    kernel_status()                     # {"native": bool, "isa": ..., "reason": ...}: IceCache.stats()["kernels"]

Environment:

* ``ICECACHE_KERNELS=off`` turns the library off (the numba kernels run; no warning, the status says why).
* ``ICECACHE_ISA=generic|avx2|avx512`` forces an instruction set (tests run each path the CPU has); one the CPU
  or the build lacks raises `KernelError` at load.

A missing or stale build (sources changed since `make setup`) is not silent: the first load warns once, in one
line, and the status carries the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from icecache.kernels import build

ISA_NAMES = ("generic", "avx2", "avx512")
ABI_VERSION = 2  # dispatch.cpp's ice_abi_version()
#: ``ice_layer_dci_rank_pages``: the int64 fields of one head's tree / scratch descriptor row
DCI_DESCRIPTOR_WIDTH = 16
#: ``ice_layer_load``: the int64 fields of one (row, KV head) unit's descriptor row
LOAD_DESCRIPTOR_WIDTH = 14
#: ``ice_layer_dci_leaf_insert``: the int64 fields of one head's descriptor row
INSERT_DESCRIPTOR_WIDTH = 34
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class KernelError(RuntimeError):
    """The native kernels were asked for something this machine or build cannot do (a forced ISA it lacks)."""


@dataclass(frozen=True)
class KernelStatus:
    """What the runtime's hot path runs on: the native library (``isa``) or the numba kernels (``reason``)."""

    native: bool
    isa: str | None
    reason: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"native": self.native, "isa": self.isa, "reason": self.reason}


class NativeKernels:
    """Typed entry points of ``libicecache_kernels.so`` (`icecache.kernels.build`). Arrays are numpy, C-contiguous;
    every call checks shapes and dtypes, then passes raw pointers."""

    def __init__(self, path: str) -> None:
        import torch  # noqa: F401  (first: its libgomp.so.1 is the OpenMP runtime the library then shares)

        lib = ctypes.CDLL(path)
        lib.ice_abi_version.restype = ctypes.c_int
        if lib.ice_abi_version() != ABI_VERSION:
            raise KernelError(f"{path}: ABI version {lib.ice_abi_version()}, expected {ABI_VERSION} (rebuild: make setup)")
        lib.ice_isa.restype = ctypes.c_char_p
        lib.ice_openmp.restype = ctypes.c_int
        self.openmp = bool(lib.ice_openmp())
        for name in ("ice_cpu_has", "ice_built_with", "ice_set_isa"):
            getattr(lib, name).argtypes = [ctypes.c_char_p]
            getattr(lib, name).restype = ctypes.c_int
        lib.ice_scores.argtypes = [_PTR, _I64, _I64, _PTR, ctypes.c_int, _I64, _PTR]
        lib.ice_scores.restype = None
        lib.ice_layer_top_tokens.argtypes = [_I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64]
        lib.ice_layer_quest_pages.argtypes = [_I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
        lib.ice_layer_quest_pages.restype = None
        lib.ice_to_half.argtypes = [_PTR, _I64, _PTR]
        lib.ice_to_half.restype = ctypes.c_int
        lib.ice_layer_top_tokens.restype = None
        lib.ice_layer_attend.argtypes = [_I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, ctypes.c_float, _PTR, _I64]
        lib.ice_layer_attend.restype = None
        lib.ice_layer_dci_rank_pages.argtypes = [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_int, _I64,
                                                 ctypes.c_int, _PTR, _I64]
        lib.ice_layer_dci_rank_pages.restype = None
        lib.ice_layer_load.argtypes = [_I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR]
        lib.ice_layer_load.restype = _I64
        lib.ice_layer_dci_leaf_insert.argtypes = [_I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR]
        lib.ice_layer_dci_leaf_insert.restype = None
        self._lib = lib
        self.path = path

    @property
    def isa(self) -> str:
        """The instruction set the kernels run on now."""
        return self._lib.ice_isa().decode()

    def cpu_has(self, isa: str) -> bool:
        return bool(self._lib.ice_cpu_has(isa.encode()))

    def built_with(self, isa: str) -> bool:
        return bool(self._lib.ice_built_with(isa.encode()))

    def available_isas(self) -> list[str]:
        """The instruction sets this build has and this CPU runs, narrowest first."""
        return [isa for isa in ISA_NAMES if self.built_with(isa) and self.cpu_has(isa)]

    def set_isa(self, isa: str) -> None:
        """Run on ``isa`` from now on (process-wide); `KernelError` when the build or the CPU lacks it."""
        code = self._lib.ice_set_isa(isa.encode())
        if code == -1:
            raise KernelError(f"instruction set {isa!r} is not in this build (built: {self.available_isas()}; known: {ISA_NAMES})")
        if code == -2:
            raise KernelError(f"this CPU does not run {isa!r} (it runs: {self.available_isas()})")

    def scores(self, queries: np.ndarray, keys: np.ndarray, n: int | None = None) -> np.ndarray:
        """``max_r q_r . keys[j]`` for the first ``n`` rows of ``keys`` ``[>= n, d]`` (float32, or float16: read
        as such); ``queries`` ``[g, d]`` float32. Returns float32 ``[n]``."""
        q = _f32(queries, 2)
        n = keys.shape[0] if n is None else n
        if keys.dtype not in (np.float32, np.float16) or keys.ndim != 2 or keys.shape[1] != q.shape[1] or not keys.flags.c_contiguous:
            raise ValueError(f"keys must be C-contiguous float32/float16 [n, {q.shape[1]}], got {keys.dtype} {keys.shape}")
        if not 0 <= n <= keys.shape[0]:
            raise ValueError(f"n={n} outside [0, {keys.shape[0]}]")
        out = np.empty(n, np.float32)
        self._lib.ice_scores(q.ctypes.data, q.shape[0], q.shape[1], keys.ctypes.data, int(keys.dtype == np.float16), n,
                             out.ctypes.data)
        return out

    def to_half(self, values: np.ndarray) -> tuple[np.ndarray, bool]:
        """``values`` (float32, C-contiguous) as float16, rounded to nearest even, and whether all stayed finite."""
        src = np.ascontiguousarray(values, dtype=np.float32)
        out = np.empty(src.shape, np.float16)
        finite = self._lib.ice_to_half(src.ctypes.data, src.size, out.ctypes.data)
        return out, bool(finite)

    def layer_top_tokens(self, queries: np.ndarray, keys32: list[np.ndarray], counts: np.ndarray, k: int,
                         keys16: list[np.ndarray] | None = None, norms: list[np.ndarray] | None = None,
                         half_done: np.ndarray | None = None,
                         threads: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every head's top ``min(k, counts[h])`` positions by ``max_r q_r . key`` (float32 scores of the float32
        keys), best first, ties by position, in one call.

        ``queries`` ``[H, g, d]`` float32; ``keys32[h]`` ``[>= counts[h], d]`` float32 rows by position. With
        ``keys16`` (float16 rows, capacity ``>= counts[h]``) and ``norms`` (float32, same capacity), a first pass
        reads the half-size copy and only keys that could reach the top k are re-scored from ``keys32``: the same
        result. ``half_done`` ``[H]`` int64 (updated in place): rows of each copy already converted; the call
        converts the rest up to ``counts[h]`` and sets -1 where a key overflows float16 (that head's copy is then
        off; its scan reads float32). None: the copies are complete. Returns ``(positions [H, k] int64, scores
        [H, k] float32, found [H] int64, rescored [H] int64)``; row h is valid up to ``found[h]``; ``rescored[h]``
        is the keys the second pass read (-1: a float32 scan).
        """
        q = _f32(queries, 3)
        heads, _, dim = q.shape
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if len(keys32) != heads or counts.shape != (heads,):
            raise ValueError(f"{heads} heads of queries, {len(keys32)} key buffers, counts {counts.shape}")
        for h, keys in enumerate(keys32):
            _check_rows(keys, np.float32, dim, int(counts[h]), f"keys32[{h}]")
        addr32 = np.array([keys.ctypes.data for keys in keys32], np.int64)
        if keys16 is not None and norms is not None:
            for h in range(heads):
                _check_rows(keys16[h], np.float16, dim, int(counts[h]), f"keys16[{h}]")
                if norms[h].dtype != np.float32 or norms[h].ndim != 1 or norms[h].shape[0] < counts[h]:
                    raise ValueError(f"norms[{h}] must be float32 [>= {counts[h]}]")
            addr16 = np.array([keys.ctypes.data for keys in keys16], np.int64)
            addrn = np.array([n.ctypes.data for n in norms], np.int64)
            if half_done is None:
                half_done = counts.copy()
            elif half_done.dtype != np.int64 or half_done.shape != (heads,) or not half_done.flags.c_contiguous:
                raise ValueError(f"half_done must be C-contiguous int64 [{heads}], got {half_done.dtype} {half_done.shape}")
        else:
            addr16 = addrn = np.zeros(heads, np.int64)
            half_done = None
        pos = np.zeros((heads, max(k, 0)), np.int64)
        scores = np.zeros((heads, max(k, 0)), np.float32)
        found = np.zeros(heads, np.int64)
        rescored = np.zeros(heads, np.int64)
        self._lib.ice_layer_top_tokens(heads, q.ctypes.data, q.shape[1], dim, addr32.ctypes.data, addr16.ctypes.data,
                                       addrn.ctypes.data, None if half_done is None else half_done.ctypes.data, counts.ctypes.data, max(k, 0), pos.ctypes.data, scores.ctypes.data,
                                       found.ctypes.data, rescored.ctypes.data, max(1, threads))
        return pos, scores, found, rescored

    def layer_quest_pages(self, queries: np.ndarray, lows: list[np.ndarray], highs: list[np.ndarray], counts: np.ndarray,
                          k: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every head's top ``min(k, counts[h])`` pages by Quest's bound ``max_r sum_c max(q_rc lo_c, q_rc hi_c)``,
        best first, ties by page row. ``queries`` ``[H, g, d]``; ``lows[h]`` / ``highs[h]`` ``[>= counts[h], d]``
        float32 page minima / maxima. Returns ``(pages [H, k] int64, scores [H, k] float32, found [H] int64)``."""
        q = _f32(queries, 3)
        heads, _, dim = q.shape
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if len(lows) != heads or len(highs) != heads or counts.shape != (heads,):
            raise ValueError(f"{heads} heads of queries, {len(lows)} / {len(highs)} bound buffers, counts {counts.shape}")
        for h in range(heads):
            _check_rows(lows[h], np.float32, dim, int(counts[h]), f"lows[{h}]")
            _check_rows(highs[h], np.float32, dim, int(counts[h]), f"highs[{h}]")
        pages = np.zeros((heads, max(k, 0)), np.int64)
        scores = np.zeros((heads, max(k, 0)), np.float32)
        found = np.zeros(heads, np.int64)
        addr_lo = np.array([x.ctypes.data for x in lows], np.int64)  # held here: the call reads them
        addr_hi = np.array([x.ctypes.data for x in highs], np.int64)
        self._lib.ice_layer_quest_pages(heads, q.ctypes.data, q.shape[1], dim, addr_lo.ctypes.data, addr_hi.ctypes.data,
                                        counts.ctypes.data, max(k, 0), pages.ctypes.data, scores.ctypes.data,
                                        found.ctypes.data, max(1, threads))
        return pages, scores, found

    def layer_attend(self, queries: np.ndarray, keys: np.ndarray, values: np.ndarray, valid: np.ndarray, scale: float,
                     threads: int = 1) -> np.ndarray:
        """Masked attention of every (row, KV head) unit: ``queries`` ``[U, g, d]``, ``keys`` / ``values``
        ``[U, S, d]`` float32, ``valid`` ``[U, S]`` bool -> ``[U, g, d]`` float32 (softmax over the valid slots;
        zeros for a unit with none)."""
        q = _f32(queries, 3)
        k, v = _f32(keys, 3), _f32(values, 3)
        units, groups, dim = q.shape
        if k.shape != v.shape or k.shape[0] != units or k.shape[2] != dim or valid.shape != k.shape[:2] or valid.dtype != np.bool_:
            raise ValueError(f"attend: queries {q.shape}, keys {k.shape}, values {v.shape}, valid {valid.shape} {valid.dtype}")
        mask = np.ascontiguousarray(valid).view(np.uint8)
        out = np.empty_like(q)
        self._lib.ice_layer_attend(units, q.ctypes.data, groups, dim, k.ctypes.data, v.ctypes.data, mask.ctypes.data,
                                   k.shape[1], float(scale), out.ctypes.data, max(1, threads))
        return out

    def layer_dci_rank_pages(self, queries: np.ndarray, trees: np.ndarray, tree_reals: np.ndarray, works: np.ndarray,
                             limits: np.ndarray, props: np.ndarray, *, per_query_beam: bool, budget: int, mass: bool,
                             threads: int = 1) -> np.ndarray:
        """The ``mdci`` page ranking of every head in one call (`icecache.indexes.dci_layer.native_rank_pages_layer`
        packs the arguments; ``dci_rank.cpp`` documents each field). ``queries`` ``[H, g, d]`` float32; ``trees`` /
        ``works`` ``[H, 16]`` int64 descriptors (array addresses and sizes; the arrays must stay alive during the
        call); ``tree_reals`` ``[H, 2]`` float64; ``limits`` ``[6]`` int64; ``props`` ``[2]`` float64. Writes each
        head's ranked pages into its scratch's ``out_pages`` / ``out_scores``; returns how many ``[H]`` int64."""
        q = _f32(queries, 3)
        heads, groups, dim = q.shape
        shapes = ((trees, np.int64, (heads, DCI_DESCRIPTOR_WIDTH)), (works, np.int64, (heads, DCI_DESCRIPTOR_WIDTH)),
                  (tree_reals, np.float64, (heads, 2)), (limits, np.int64, (6,)), (props, np.float64, (2,)))
        for array, dtype, shape in shapes:
            if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
                raise ValueError(f"dci rank: expected C-contiguous {np.dtype(dtype).name} {shape}, got {array.dtype} {array.shape}")
        counts = np.zeros(heads, np.int64)
        self._lib.ice_layer_dci_rank_pages(heads, trees.ctypes.data, tree_reals.ctypes.data, works.ctypes.data,
                                           limits.ctypes.data, props.ctypes.data, q.ctypes.data, groups, dim,
                                           int(per_query_beam), int(budget), int(mass), counts.ctypes.data,
                                           max(1, threads))
        return counts

    def layer_load(self, units: np.ndarray, slot_pos: np.ndarray, keys: np.ndarray, values: np.ndarray,
                   region_start: int) -> tuple[int, np.ndarray]:
        """The CPU bulk load of one layer step (`icecache.runtime.loader.BulkLoader` packs ``units``, ``[U, 14]``
        int64 descriptors; ``layer_load.cpp`` documents the fields; the arrays they address must stay alive).
        ``slot_pos`` ``[U, budget]`` int64 (updated); ``keys`` / ``values`` ``[U, slots, dim]`` numpy views of the
        layer's buffers, written in place (the slots' mask is the caller's). Returns ``(code, stats [U, 3])``: code
        0, ``-1 - u`` (unit u's selection exceeds the budget) or ``-1000000 - u`` (a position of unit u has no host
        row); stats = (pages selected, pages reused, rows copied) per unit."""
        n_units, budget = slot_pos.shape
        if units.dtype != np.int64 or units.shape != (n_units, LOAD_DESCRIPTOR_WIDTH) or not units.flags.c_contiguous:
            raise ValueError(f"layer load: units must be C-contiguous int64 [{n_units}, {LOAD_DESCRIPTOR_WIDTH}]")
        if (slot_pos.dtype != np.int64 or not slot_pos.flags.c_contiguous or keys.shape != values.shape
                or keys.dtype != values.dtype or keys.ndim != 3 or keys.shape[0] != n_units
                or not (keys.flags.c_contiguous and values.flags.c_contiguous)):
            raise ValueError(f"layer load: slot_pos {slot_pos.dtype} {slot_pos.shape}, keys {keys.dtype} {keys.shape}, "
                             f"values {values.shape}")
        slots, dim = keys.shape[1], keys.shape[2]
        if not 0 <= region_start <= slots - budget:
            raise ValueError(f"layer load: budget region [{region_start}, {region_start + budget}) outside {slots} slots")
        stats = np.zeros((n_units, 3), np.int64)
        code = self._lib.ice_layer_load(n_units, units.ctypes.data, slot_pos.ctypes.data, budget, keys.ctypes.data,
                                        values.ctypes.data, slots, region_start, dim, keys.dtype.itemsize,
                                        stats.ctypes.data)
        return int(code), stats

    def layer_dci_leaf_insert(self, desc: np.ndarray, reals: np.ndarray, keys: np.ndarray, new_k: np.ndarray,
                              new_v: np.ndarray) -> np.ndarray:
        """The ``mdci`` decode insert of one key per head (`icecache.indexes.dci_decode_insert.insert_layer_stored`
        packs ``desc`` ``[H, 34]`` int64, ``dci_insert.cpp`` documents the fields; the arrays they address must stay
        alive and have room for the point). ``reals`` ``[H, 4]`` float64; ``keys`` ``[H, d]`` float32; ``new_k`` /
        ``new_v`` ``[H, hd]`` in the host store's raw dtype. Returns ``[H, 7]`` int64: ``(status, level, new_top,
        parent, page, slot, neighbour)`` per head, as `_leaf_stored` returns them."""
        q = _f32(keys, 2)
        heads, dim = q.shape
        if desc.dtype != np.int64 or desc.shape != (heads, INSERT_DESCRIPTOR_WIDTH) or not desc.flags.c_contiguous:
            raise ValueError(f"leaf insert: desc must be C-contiguous int64 [{heads}, {INSERT_DESCRIPTOR_WIDTH}]")
        if reals.dtype != np.float64 or reals.shape != (heads, 4) or not reals.flags.c_contiguous:
            raise ValueError(f"leaf insert: reals must be C-contiguous float64 [{heads}, 4]")
        if (new_k.shape != new_v.shape or new_k.dtype != new_v.dtype or new_k.ndim != 2 or new_k.shape[0] != heads
                or not (new_k.flags.c_contiguous and new_v.flags.c_contiguous)):
            raise ValueError(f"leaf insert: new K/V {new_k.dtype} {new_k.shape} / {new_v.shape}, expected [{heads}, hd]")
        out = np.zeros((heads, 7), np.int64)
        self._lib.ice_layer_dci_leaf_insert(heads, desc.ctypes.data, reals.ctypes.data, q.ctypes.data, dim,
                                            new_k.ctypes.data, new_v.ctypes.data, new_k.shape[1] * new_k.itemsize,
                                            out.ctypes.data)
        return out


def array_address(array: np.ndarray) -> int:
    """The address of an array's first element (for a descriptor row; the array must outlive the call)."""
    return array.__array_interface__["data"][0]


def cached_row(owner: Any, slot: str, arrays: tuple[np.ndarray, ...],
               make: Callable[[tuple[np.ndarray, ...]], np.ndarray]) -> np.ndarray:
    """A descriptor row built by ``make(arrays)`` (addresses and sizes), cached on ``owner`` as attribute ``slot``
    while ``owner`` still holds the very same array objects: the cache keeps them alive, so an address cannot go
    stale while it is cached, and an edit that replaces an array (growth, a rebuilt slab) makes a new row. The
    arrays must be C-contiguous (else ValueError: a copy would be freed after the call)."""
    cached = getattr(owner, slot, None)
    if cached is not None and len(cached[0]) == len(arrays) and all(a is b for a, b in zip(arrays, cached[0])):
        return cached[1]
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError(f"{type(owner).__name__}: a native descriptor needs C-contiguous arrays")
    row = make(arrays)
    setattr(owner, slot, (arrays, row))
    return row


def _f32(x: np.ndarray, ndim: int) -> np.ndarray:
    if x.dtype != np.float32 or x.ndim != ndim or not x.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous float32 array of {ndim} dims, got {x.dtype} {x.shape}")
    return x


def _check_rows(keys: np.ndarray, dtype: type, dim: int, n: int, name: str) -> None:
    if keys.dtype != dtype or keys.ndim != 2 or keys.shape[1] != dim or keys.shape[0] < n or not keys.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous {np.dtype(dtype).name} [>= {n}, {dim}], got {keys.dtype} {keys.shape}")


_loaded: dict[str, Any] = {}  # the one loaded library and its status (a process-wide registry of one)


def native_kernels() -> NativeKernels | None:
    """The loaded library, or None when it is off, missing or stale (`kernel_status` says which; a missing or
    stale build warns once). ``ICECACHE_ISA`` is applied at the first load."""
    if "status" not in _loaded:
        _loaded["kernels"], _loaded["status"] = _load()
        reason = _loaded["status"].reason
        if _loaded["kernels"] is None and reason is not None and not reason.startswith("off"):
            warnings.warn(f"icecache: native kernels not used ({reason}); running the numba kernels", RuntimeWarning,
                          stacklevel=2)
    return _loaded["kernels"]


def kernel_status() -> KernelStatus:
    """What the hot path runs on (loads the library if needed)."""
    native_kernels()
    status: KernelStatus = _loaded["status"]
    kernels = _loaded["kernels"]
    return KernelStatus(True, kernels.isa, None) if kernels is not None else status


@contextlib.contextmanager
def numba_kernels() -> Iterator[None]:
    """Run the numba kernels inside the block, as with ``ICECACHE_KERNELS=off`` (a benchmark compares both paths in
    one process). Pagers built inside keep no float16 copy. Not thread-safe: nothing else may run kernels meanwhile."""
    native_kernels()
    saved = dict(_loaded)
    _loaded.update(kernels=None, status=KernelStatus(False, None, "off: inside numba_kernels()"))
    try:
        yield
    finally:
        _loaded.clear()
        _loaded.update(saved)


def _load() -> tuple[NativeKernels | None, KernelStatus]:
    if os.environ.get("ICECACHE_KERNELS", "").lower() in ("off", "0", "numba"):
        return None, KernelStatus(False, None, "off: ICECACHE_KERNELS=off")
    if not build.LIBRARY.exists():
        return None, KernelStatus(False, None, "not built: run `make setup` (python -m icecache.kernels.build)")
    if not build.is_current():
        return None, KernelStatus(False, None, "stale: the sources changed since the build; run `make setup`")
    kernels = NativeKernels(str(build.LIBRARY))
    forced = os.environ.get("ICECACHE_ISA")
    if forced:
        kernels.set_isa(forced)
    return kernels, KernelStatus(True, kernels.isa, None)
