"""Sparse decode attention on the CPU: one compiled, single-threaded kernel for the small per-layer problem.

A sparse layer's decode attention is tiny (``[B, H, n_rep]`` queries over sink + window + budget slots). Run
through torch's SDPA with two intra-op threads, its fork/join waits on the core that the background insert
worker holds (SmolLM2, 8k: 10.2 ms per step over 28 layers, interleaved benchmark). Capping torch's threads
around it is process-wide and raised the RSS slope of long soaks; this kernel runs on the caller's thread
and touches no global setting. On CUDA the runtime keeps SDPA.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from icecache.kernels.library import native_kernels


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _attend(q, k, v, valid, scale, out):
    """``q`` ``[B, H, R, D]``, ``k``/``v`` ``[B, H, S, D]``, ``valid`` ``[B, H, S]`` -> ``out`` ``[B, H, R, D]``
    (softmax over the valid slots; a row with none gets zeros)."""
    B, H, R, D = q.shape
    S = k.shape[2]
    w = np.empty(S, np.float64)
    acc = np.empty(D, np.float64)
    for b in range(B):
        for h in range(H):
            for r in range(R):
                m = -np.inf
                for j in range(S):
                    if valid[b, h, j]:
                        s = 0.0
                        for i in range(D):
                            s += np.float64(q[b, h, r, i]) * np.float64(k[b, h, j, i])
                        s *= scale
                        w[j] = s
                        if s > m:
                            m = s
                for i in range(D):
                    acc[i] = 0.0
                if m == -np.inf:
                    for i in range(D):
                        out[b, h, r, i] = 0.0
                    continue
                tot = 0.0
                for j in range(S):
                    if valid[b, h, j]:
                        e = math.exp(w[j] - m)
                        tot += e
                        for i in range(D):
                            acc[i] += e * np.float64(v[b, h, j, i])
                for i in range(D):
                    out[b, h, r, i] = acc[i] / tot


def sparse_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                         *, native: bool = True) -> torch.Tensor:
    """Masked attention of ``q`` ``[B, H, R, D]`` over ``k``/``v`` ``[B, H, S, D]`` where ``valid`` ``[B, H, S]``
    (bool), float32 CPU tensors; returns ``[B, H, R, D]`` in ``q``'s dtype. Equals SDPA with the boolean mask
    ``valid[:, :, None, :]`` up to float rounding.

    Runs the native kernel (`icecache.kernels`: float32, vectorised, one call for every (row, head)) when the
    library is loaded and ``native``; else the numba kernel (float64 accumulation)."""
    kernels = native_kernels() if native else None
    mask = valid.numpy() if valid.is_contiguous() else valid.contiguous().numpy()
    if kernels is not None:
        B, H, R, D = q.shape
        S = k.shape[2]
        out = kernels.layer_attend(_as_f32(q).reshape(B * H, R, D), _as_f32(k).reshape(B * H, S, D),
                                   _as_f32(v).reshape(B * H, S, D), mask.reshape(B * H, S), float(scale)).reshape(B, H, R, D)
    else:
        out = np.empty(tuple(q.shape), np.float32)
        _attend(_as_f32(q), _as_f32(k), _as_f32(v), mask, float(scale), out)
    res = torch.from_numpy(out)
    return res if q.dtype == torch.float32 else res.to(q.dtype)


def _as_f32(t: torch.Tensor) -> np.ndarray:
    """A float32, C-contiguous numpy view of ``t`` (a copy only when it is not one already): the runtime's
    buffers are, so the per-layer call makes no torch op (each one costs a GIL round trip that the background
    insert worker can hold up)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t.detach().numpy()
    return t.detach().to(torch.float32).contiguous().numpy()
