"""`TokenPlacement`: where every token of one sparse layer lives, and the host inserts that move it there.

Token span of one batch row at logical length T (``pad`` = the row's left padding)::

    | pad | sink |             middle: host pages + pager              |  window  |
    0     pad    pad+sink                                         T-window        T
                 <-- offloaded as tokens leave the window (insert) --

Device buffers per (row, KV head), with a validity mask beside them::

    [ sink slots | budget slots | window ring ]
    0            sink_slots     ring_start     slots

Position ``p`` of the window sits in ring slot ``ring_start + p % window``; the budget slots hold the pages the
selection brought in (`BulkLoader`). Every position of a row is in exactly one of: a sink slot, one host page,
the window ring (the conservation invariant, `check_conservation`).

Each region is sized for what the sequence can use (`slots_for`): at length T at most ``min(sink, T - window)``
tokens have become sinks, at most ``min(budget, T - window - sink)`` middle tokens can be selected and at most
``min(window, T)`` tokens are in the window. A region grows (doubling, up to its configured size) when decoding
needs more, so a 31-token prompt with a 100k-token window allocates 31 window slots, not 100k. Growth keeps the
order of the occupied slots, so attention sees the same tokens in the same order as in full-size buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from icecache.core.errors import CacheMisuseError, InputError
from icecache.runtime.loader import BulkLoader
from icecache.runtime.store import HeadStore


class TokenPlacement:
    """Device buffers, pagers and host stores of one sparse layer, and the token moves between them.

    Parameters
    ----------
    layer_idx, num_kv_heads, head_dim : int
        The layer and its K/V shape.
    sink, window, budget : int
        Configured sink tokens, window tokens and budget slots (`IceCacheConfig`).

    Touches nothing outside the layer: background jobs, timers and fault hooks belong to the caller.
    """

    def __init__(self, layer_idx: int, num_kv_heads: int, head_dim: int, *, sink: int, window: int, budget: int) -> None:
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sink, self.window, self.budget = sink, window, budget
        self.length = 0  # logical tokens seen (including padding)
        self.batch_size = 0
        self.sink_slots = self.budget_slots = self.window_slots = 0
        self.keys: torch.Tensor | None = None  # [batch_size, num_kv_heads, slots, head_dim]
        self.values: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # [batch_size, num_kv_heads, slots] bool: attend to this slot
        self.pagers: list[list[Any]] = []  # [row][kv head]
        self.stores: list[list[HeadStore]] = []
        self.loader: BulkLoader | None = None
        self.pad = np.zeros(0, dtype=np.int64)  # left padding of each row
        self.num_sinks = np.zeros(0, dtype=np.int64)  # sink slots filled in each row
        #: positions below this one have been handed to a sink slot or the host pages (a prefetched insert
        #: hands the next leaving token over while it is still in the window)
        self.offloaded_until = 0

    # ------------------------------------------------------------------ layout
    @property
    def ring_start(self) -> int:
        return self.sink_slots + self.budget_slots

    @property
    def slots(self) -> int:
        return self.sink_slots + self.budget_slots + self.window_slots

    def ring_slot(self, pos: int) -> int:
        """Buffer slot of absolute position ``pos`` while it is in the window."""
        return self.ring_start + pos % self.window

    def slots_for(self, length: int) -> tuple[int, int, int]:
        """``(sink, budget, window)`` slots a sequence of ``length`` positions can use (see module docstring)."""
        left = max(0, length - self.window)  # positions that have left the window
        return min(self.sink, left), min(self.budget, max(0, left - self.sink)), min(self.window, length)

    def allocate(self, batch_size: int, dtype: torch.dtype, device: torch.device, pagers: list[list[Any]],
                 max_length: int) -> None:
        """Create the device buffers (sized for ``max_length`` positions), host stores and bulk loader."""
        for row in pagers:
            for p in row:
                if not p.table.record_moves:
                    raise CacheMisuseError("a pager_factory must create pagers with record_moves=True")
        self.batch_size = batch_size
        self.sink_slots, self.budget_slots, self.window_slots = self.slots_for(max_length)
        shape = (batch_size, self.num_kv_heads, self.slots, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(shape[:3], dtype=torch.bool, device=device)
        self.pagers = pagers
        pin = self.keys.device.type == "cuda"
        self.stores = [[HeadStore(p.table, self.head_dim, dtype, pin=pin) for p in row] for row in pagers]
        self.loader = BulkLoader(self.keys, self.values, self.valid, self.sink_slots, self.budget_slots)
        self.pad = np.zeros(batch_size, dtype=np.int64)
        self.num_sinks = np.zeros(batch_size, dtype=np.int64)
        self.offloaded_until = 0

    def ensure_slots(self, length: int) -> None:
        """Grow the regions that a sequence of ``length`` positions outgrows (each at least doubles, up to its
        configured size); occupied slots keep their order, the bulk loader keeps its residency."""
        need = self.slots_for(length)
        have = (self.sink_slots, self.budget_slots, self.window_slots)
        if all(n <= h for n, h in zip(need, have)):
            return
        limits = (self.sink, self.budget, self.window)
        sink, budget, window = (h if n <= h else min(lim, max(n, 2 * h)) for n, h, lim in zip(need, have, limits))
        old = (self.keys, self.values, self.valid)
        # (old start, new start, length) of the sink, budget and ring regions
        moves = ((0, 0, have[0]), (have[0], sink, have[1]), (have[0] + have[1], sink + budget, have[2]))
        self.sink_slots, self.budget_slots, self.window_slots = sink, budget, window
        B, H, _, D = self.keys.shape
        self.keys = self.keys.new_zeros(B, H, self.slots, D)
        self.values = self.values.new_zeros(B, H, self.slots, D)
        self.valid = self.valid.new_zeros(B, H, self.slots)
        for new_buf, old_buf in zip((self.keys, self.values, self.valid), old):
            for src, dst, n in moves:
                new_buf[:, :, dst : dst + n] = old_buf[:, :, src : src + n]
        self.loader.resize(self.keys, self.values, self.valid, sink, budget)

    # ------------------------------------------------------------------ prefill
    def place_prefill(self, k: torch.Tensor, v: torch.Tensor,
                      valid: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Place the prefill K/V ``[B, H, T, D]``: the last ``window`` positions in the ring, each row's first
        ``sink`` real tokens in its sink slots. Returns each row's middle K/V (host copies ``[H, m, D]``) for
        the host pages and pagers.

        ``valid`` ``[B, T]`` bool marks non-padding tokens (None: all valid). Padding must be on the left.
        """
        B, H, T, D = k.shape
        S, W = self.sink, self.window
        if valid is None:
            pad = np.zeros(B, dtype=np.int64)
        else:
            vm = valid.to("cpu", torch.bool).numpy()
            pad = np.argmax(vm, axis=1).astype(np.int64)
            pad[~vm.any(axis=1)] = T
            if not all(vm[b, pad[b]:].all() for b in range(B)):
                raise CacheMisuseError("IceCache supports left padding only (a row has padding after a real token)")
        self.pad = pad
        self.ensure_slots(T)
        # window ring: the last W positions
        w0 = max(0, T - W)
        self.offloaded_until = w0
        wpos = torch.arange(w0, T)
        ring = self.ring_start + wpos % W
        self.keys[:, :, ring] = k[:, :, w0:T]
        self.values[:, :, ring] = v[:, :, w0:T]
        ok = torch.from_numpy(wpos.numpy()[None, :] >= pad[:, None]).to(self.keys.device)  # [B, n]
        self.valid[:, :, ring] = ok[:, None, :].expand(B, H, -1)
        # positions that already left the window: sinks and middle
        middles = []
        for b in range(B):
            p0 = int(pad[b])
            sink_end = min(p0 + S, w0)
            ns = max(0, sink_end - p0)
            if ns:
                self.keys[b, :, :ns] = k[b, :, p0:sink_end]
                self.values[b, :, :ns] = v[b, :, p0:sink_end]
                self.valid[b, :, :ns] = True
            self.num_sinks[b] = ns
            m0 = p0 + S
            if w0 > m0:
                k_mid = k[b, :, m0:w0].to("cpu")
                v_mid = v[b, :, m0:w0].to("cpu")
                if k.device.type == "cuda":
                    torch.cuda.current_stream(k.device).synchronize()
            else:
                k_mid = v_mid = k.new_zeros(H, 0, D, device="cpu")
            middles.append((k_mid, v_mid))
        return middles

    def build_host(self, b: int, h: int, k_mid: torch.Tensor, v_mid: torch.Tensor) -> None:
        """Build the pager of (row ``b``, KV head ``h``) on its middle keys and fill its host store."""
        pager = self.pagers[b][h]
        table, journaled = pager.table, pager.table.record_moves
        table.record_moves = False  # a fresh build's journal would only say "every position is new"
        try:
            pager.build(k_mid)
        finally:
            table.record_moves = journaled
        self.stores[b][h].load_layout(k_mid, v_mid)

    # ------------------------------------------------------------------ decode
    def append_token(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new token ``[B, H, 1, D]`` into the window ring; the token it displaces becomes a sink or,
        unless a prefetched insert took it already, goes to the host pages now."""
        S, W = self.sink, self.window
        p = self.length
        self.ensure_slots(p + 1)
        self.length += 1
        ring = self.ring_slot(p)
        old = p - W
        if old >= 0:  # the token in this ring slot leaves the window now
            if self.offloaded_until <= old:  # not prefetched: insert it into the host pages now
                kc, vc = self.take_leaving(old)
                self.insert_host(old, kc, vc)
            for b in range(self.batch_size):
                p0 = int(self.pad[b])
                if p0 <= old < p0 + S:  # one of the row's first S real tokens: a sink
                    j = old - p0
                    self.keys[b, :, j] = self.keys[b, :, ring]
                    self.values[b, :, j] = self.values[b, :, ring]
                    self.valid[b, :, j] = True
                    self.num_sinks[b] = j + 1
        self.keys[:, :, ring] = k[:, :, 0]
        self.values[:, :, ring] = v[:, :, 0]
        self.valid[:, :, ring] = True

    def take_leaving(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, H, D]`` (host copies) of the window token at absolute position ``pos``, handed over."""
        ring = self.ring_slot(pos)
        kc = self.keys[:, :, ring].to("cpu")
        vc = self.values[:, :, ring].to("cpu")
        if not np.isfinite(kc.numpy() if kc.dtype == torch.float32 else kc.float().numpy()).all():
            raise InputError(f"layer {self.layer_idx}: the model produced NaN/inf keys")
        self.offloaded_until = pos + 1
        return kc, vc

    def insert_host(self, pos: int, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """Insert the token at absolute position ``pos`` into every row's pagers and host stores where it is a
        middle token. Touches only this layer's pagers and stores (safe on a worker thread)."""
        keys32 = kc.float()
        for b in range(self.batch_size):
            p0 = int(self.pad[b])
            if pos < p0 + self.sink:
                continue  # padding or a sink
            local = pos - p0 - self.sink
            # one [1, D] view per KV head, made in one call each (indexing per head costs ~1 us a time)
            heads = zip(self.pagers[b], self.stores[b], keys32[b, :, None].unbind(0), kc[b, :, None].unbind(0),
                        vc[b, :, None].unbind(0))
            for pager, store, key32, key, value in heads:
                assert len(pager) == local, "pager positions out of step with the sequence"
                store.insert_token(pager, key32, key, value, local)

    def next_leaving(self) -> int | None:
        """The position that leaves the window at the next step, if some row will insert it into its host pages
        and it has not been handed over yet (None otherwise)."""
        nxt = self.length - self.window
        if nxt < 0 or self.offloaded_until > nxt:
            return None
        if all(nxt < int(p0) + self.sink for p0 in self.pad):
            return None  # padding or sinks only: handled synchronously when it leaves
        return nxt

    # ------------------------------------------------------------------ introspection
    def offloaded_tokens(self) -> int:
        """Middle tokens (summed over rows) that have left the window for the host pages."""
        left = self.length - self.window
        return int(sum(max(0, left - int(p0) - self.sink) for p0 in self.pad))

    def host_kv(self, b: int, h: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Host middle K/V of (row ``b``, KV head ``h``) in position order: ``(absolute positions [m], K [m, D],
        V [m, D])``."""
        n = len(self.pagers[b][h])
        k, v = self.stores[b][h].read(np.arange(n))
        return np.arange(n) + int(self.pad[b]) + self.sink, k, v

    def check_conservation(self) -> None:
        """Every position of every row is in exactly one of sink / one host page / window (AssertionError if
        not). Background inserts must have finished."""
        T, S, W = self.length, self.sink, self.window
        for b in range(self.batch_size):
            p0 = int(self.pad[b])
            counts = np.zeros(T, dtype=np.int64)
            counts[p0 : p0 + int(self.num_sinks[b])] += 1
            counts[max(0, T - W) : T] += 1
            for h in range(self.num_kv_heads):
                pager = self.pagers[b][h]
                c = counts.copy()
                pos = np.concatenate(list(pager.table.as_dict().values()) or [np.zeros(0, np.int64)])
                absolute = pos + p0 + S
                prefetched = absolute >= max(0, T - W)  # inserted ahead while still in the window
                assert (absolute[prefetched] < self.offloaded_until).all(), "host holds a window token nobody prefetched"
                np.add.at(c, absolute[~prefetched], 1)
                pager.table.check()
                assert len(pager) == len(pos), f"layer {self.layer_idx}: pager size != paged positions"
                assert (c[:p0] == 0).all(), "padding is stored somewhere"
                assert (c[p0:] == 1).all(), (
                    f"layer {self.layer_idx} row {b} head {h}: positions {np.flatnonzero(c[p0:] != 1)[:8] + p0} "
                    "are not in exactly one of sink / host page / window"
                )

    def device_bytes(self) -> int:
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()

    def release(self) -> None:
        """Drop the device buffers, pagers and host stores."""
        self.pagers = []
        self.stores = []
        self.loader = None
        self.keys = self.values = self.valid = None
