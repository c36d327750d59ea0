"""`TokenPlacement`: where every token of one sparse layer lives, and the host inserts that move it there.

Token span of one batch row at logical length T (``pad`` = the row's left padding)::

    | pad | sink |             middle: host pages + pager              |  window  |
    0     pad    pad+sink                                         T-window        T
                 <-- offloaded as tokens leave the window (insert) --

Device buffers per (row, KV head), with a validity mask beside them::

    [ sink slots | budget slots | window ring ]
    0            sink_slots     ring_start     slots

Position ``p`` of the window sits in ring slot ``ring_start + p % ring_size``; the budget slots hold the pages the
selection brought in (`BulkLoader`). Every position of a row is in exactly one of: a sink slot, one host page,
the window ring (the conservation invariant, `check_conservation`).

Tokens leave the window ``insert_every`` (G) at a time (`IceCacheConfig.insert_every`): the ring holds
``ring_size = window + G - 1`` slots, the window between ``window`` and ``window + G - 1`` tokens, and when it is
full the G oldest go to the host pages in one insert per (row, KV head). Each layer starts at its own phase
(``layer_idx % G`` extra tokens after the prefill), so one decode step flushes about 1/G of the layers. G = 1 is
one token per step, as without the option.

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
    insert_every : int
        Tokens that leave the window together (`IceCacheConfig.insert_every`; see the module docstring).

    Touches nothing outside the layer: background jobs, timers and fault hooks belong to the caller.
    """

    def __init__(self, layer_idx: int, num_kv_heads: int, head_dim: int, *, sink: int, window: int, budget: int,
                 insert_every: int = 1) -> None:
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sink, self.window, self.budget = sink, window, budget
        self.insert_every = insert_every
        self.ring_size = window + insert_every - 1  # the most tokens the window holds
        self.phase = layer_idx % insert_every  # extra window tokens after the prefill (staggers the layers' flushes)
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
        #: hands the next leaving tokens over while they are still in the window)
        self.offloaded_until = 0
        #: the oldest position still in the window ring
        self.window_start = 0

    # ------------------------------------------------------------------ layout
    @property
    def ring_start(self) -> int:
        return self.sink_slots + self.budget_slots

    @property
    def slots(self) -> int:
        return self.sink_slots + self.budget_slots + self.window_slots

    def ring_slot(self, pos: int) -> int:
        """Buffer slot of absolute position ``pos`` while it is in the window."""
        return self.ring_start + pos % self.ring_size

    def slots_for(self, length: int) -> tuple[int, int, int]:
        """``(sink, budget, window)`` slots a sequence of ``length`` positions can use (see module docstring)."""
        left = max(0, length - self.window)  # positions that may have left the window
        return min(self.sink, left), min(self.budget, max(0, left - self.sink)), min(self.ring_size, length)

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
        self.offloaded_until = self.window_start = 0

    def ensure_slots(self, length: int) -> None:
        """Grow the regions that a sequence of ``length`` positions outgrows (each at least doubles, up to its
        configured size); occupied slots keep their order, the bulk loader keeps its residency."""
        need = self.slots_for(length)
        have = (self.sink_slots, self.budget_slots, self.window_slots)
        if all(n <= h for n, h in zip(need, have)):
            return
        limits = (self.sink, self.budget, self.ring_size)
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
        """Place the prefill K/V ``[B, H, T, D]``: the last ``window + phase`` positions in the ring, each row's
        first ``sink`` real tokens in its sink slots. Returns each row's middle K/V (host copies ``[H, m, D]``) for
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
        # window ring: the last W (+ this layer's phase) positions
        w0 = max(0, T - W - self.phase)
        self.offloaded_until = self.window_start = w0
        wpos = torch.arange(w0, T)
        ring = self.ring_start + wpos % self.ring_size
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
        """Write the new token ``[B, H, 1, D]`` into the window ring. When the ring is full, its ``insert_every``
        oldest tokens leave it: each becomes a sink or, unless a prefetched insert took it already, goes to the
        host pages now."""
        S, G = self.sink, self.insert_every
        p = self.length
        self.ensure_slots(p + 1)
        self.length += 1
        if p - self.window_start >= self.ring_size:  # the ring is full: its G oldest tokens leave the window
            first = self.window_start
            if self.offloaded_until <= first:  # not prefetched: insert them into the host pages now
                kc, vc = self.take_leaving(first, G)
                self.insert_host(first, kc, vc)
            for b in range(self.batch_size):
                p0 = int(self.pad[b])
                for old in range(max(first, p0), min(first + G, p0 + S)):  # the row's first S real tokens: sinks
                    j = old - p0
                    ring = self.ring_slot(old)
                    self.keys[b, :, j] = self.keys[b, :, ring]
                    self.values[b, :, j] = self.values[b, :, ring]
                    self.valid[b, :, j] = True
                    self.num_sinks[b] = j + 1
            self.window_start = first + G
            if G > 1:  # the freed slots hold nothing until the window reaches them again
                self.valid[:, :, self.ring_slots(first + 1, G - 1)] = False
        ring = self.ring_slot(p)
        self.keys[:, :, ring] = k[:, :, 0]
        self.values[:, :, ring] = v[:, :, 0]
        self.valid[:, :, ring] = True

    def ring_slots(self, first: int, count: int) -> torch.Tensor:
        """Ring slots of the window positions ``first .. first + count - 1``, ``[count]`` (int64)."""
        return torch.from_numpy(self.ring_start + np.arange(first, first + count) % self.ring_size).to(self.keys.device)

    def take_leaving(self, first: int, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, H, count, D]`` (host copies) of the window positions ``first .. first + count - 1``, handed
        over."""
        if count == 1:
            ring = self.ring_slot(first)
            kc = self.keys[:, :, ring : ring + 1].to("cpu")
            vc = self.values[:, :, ring : ring + 1].to("cpu")
        else:
            slots = self.ring_slots(first, count)
            kc = self.keys.index_select(2, slots).to("cpu")
            vc = self.values.index_select(2, slots).to("cpu")
        if not np.isfinite(kc.numpy() if kc.dtype == torch.float32 else kc.float().numpy()).all():
            raise InputError(f"layer {self.layer_idx}: the model produced NaN/inf keys")
        self.offloaded_until = first + count
        return kc, vc

    def insert_host(self, first: int, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """Insert the tokens at absolute positions ``first ..`` (K/V ``[B, H, n, D]``) into every row's pagers and
        host stores where they are middle tokens, head by head (a head's index stays in the caches for its n
        inserts). Touches only this layer's pagers and stores (safe on a worker thread)."""
        n = kc.shape[2]
        keys32 = kc.float()
        for b in range(self.batch_size):
            start = int(self.pad[b]) + self.sink  # the row's first middle position
            skip = max(0, start - first)  # padding or sinks
            if skip >= n:
                continue
            local = first + skip - start
            for pager in self.pagers[b]:
                assert len(pager) == local, "pager positions out of step with the sequence"
            if n - skip == 1 and HeadStore.insert_layer_token(self.pagers[b], self.stores[b], keys32[b, :, skip],
                                                              kc[b, :, skip], vc[b, :, skip], local):
                continue  # every head in one pager call (mdci)
            # one view per KV head, made in one call each (indexing per head costs ~1 us a time)
            heads = zip(self.pagers[b], self.stores[b], keys32[b, :, skip:].unbind(0), kc[b, :, skip:].unbind(0),
                        vc[b, :, skip:].unbind(0))
            for pager, store, key32, key, value in heads:
                store.insert_tokens(pager, key32, key, value, local)

    def next_leaving(self) -> int | None:
        """The first of the ``insert_every`` positions that leave the window at the next step, if some row will
        insert one of them into its host pages and they have not been handed over yet (None otherwise)."""
        if self.length - self.window_start < self.ring_size:
            return None  # the next step only fills the ring
        nxt = self.window_start
        if self.offloaded_until > nxt:
            return None
        if all(nxt + self.insert_every <= int(p0) + self.sink for p0 in self.pad):
            return None  # padding or sinks only: handled synchronously when they leave
        return nxt

    # ------------------------------------------------------------------ introspection
    def offloaded_tokens(self) -> int:
        """Middle tokens (summed over rows) that have left the window for the host pages."""
        left = self.window_start
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
        T, S, w0 = self.length, self.sink, self.window_start
        assert T - w0 <= self.ring_size and (T - w0 >= min(T, self.window)), "window size out of range"
        for b in range(self.batch_size):
            p0 = int(self.pad[b])
            counts = np.zeros(T, dtype=np.int64)
            counts[p0 : p0 + int(self.num_sinks[b])] += 1
            counts[w0:T] += 1
            for h in range(self.num_kv_heads):
                pager = self.pagers[b][h]
                c = counts.copy()
                pos = np.concatenate(list(pager.table.as_dict().values()) or [np.zeros(0, np.int64)])
                absolute = pos + p0 + S
                prefetched = absolute >= w0  # inserted ahead while still in the window
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
