"""MIPS -> Euclidean nearest-neighbour transforms (docs/index.md, MIPS to L2 transform).

Maximum inner product search over keys becomes an L2 nearest-neighbour search by lifting every key onto
a sphere with one extra coordinate and normalising the query:

* paper form (IceFormer):  T_K(k) = [k / c, sqrt(1 - |k|^2 / c^2)],  T_Q(q) = [q / |q|, 0]
  so that |T_Q(q) - T_K(k)|^2 = 2 - 2 <q, k> / (c |q|);
* scaled form (what the M-DCI code stores): c T_K(k) = [k, sqrt(c^2 - |k|^2)] (every key has norm c),
  with the same T_Q, so |T_Q(q) - c T_K(k)|^2 = c^2 + 1 - 2 <q, k> / |q|.

In both forms c >= max |k|, every transformed key has the same norm, and the L2 nearest transformed key is
the key with the largest <q, k>. A key longer than c (later, larger keys during decoding, or rounding)
would make the square root negative: it is clamped at 0, so no NaN can appear. A zero query maps to the
zero vector (every key is then equally near, as every <0, k> = 0 is equal).
"""

from __future__ import annotations

from typing import Literal

import torch

Form = Literal["paper", "scaled"]


def max_sq_norm(keys: torch.Tensor) -> float:
    """Largest squared L2 norm of ``keys`` ``[n, d]`` (0.0 for n = 0)."""
    if keys.shape[0] == 0:
        return 0.0
    return float(keys.double().pow(2).sum(-1).max())


def transform_keys(keys: torch.Tensor, c: float | None = None, form: Form = "paper") -> torch.Tensor:
    """Lift keys ``[n, d]`` to ``[n, d + 1]`` (see module docstring). ``c`` defaults to the max key norm.

    All outputs have norm 1 (paper form) or ``c`` (scaled form) for keys with |k| <= c.
    """
    if form not in ("paper", "scaled"):
        raise ValueError(f"form must be 'paper' or 'scaled', got {form!r}")
    k = keys.to(torch.float64)
    sq = k.pow(2).sum(-1, keepdim=True)
    if c is None:
        c = float(sq.max().sqrt()) if k.shape[0] else 1.0
    if c <= 0.0:  # all-zero keys: any positive c works
        c = 1.0
    extra = (c * c - sq).clamp_min(0.0).sqrt()
    out = torch.cat([k, extra], dim=-1)
    if form == "paper":
        out = out / c
    return out.to(keys.dtype)


def transform_queries(queries: torch.Tensor) -> torch.Tensor:
    """Map queries ``[g, d]`` to ``[g, d + 1]``: ``[q / |q|, 0]`` (a zero query maps to zeros)."""
    q = queries.to(torch.float64)
    norm = q.norm(dim=-1, keepdim=True)
    q = torch.where(norm > 0, q / norm.clamp_min(1e-300), torch.zeros_like(q))
    return torch.cat([q, torch.zeros_like(q[:, :1])], dim=-1).to(queries.dtype)


def key_key_distance(a: torch.Tensor, b: torch.Tensor, msq: float) -> torch.Tensor:
    """Half the squared distance between scaled-form transformed keys, ``[len(a), len(b)]``, clamped >= 0.

    ``msq - <a_i, b_j> - sqrt((msq - |a_i|^2)(msq - |b_j|^2))`` with ``msq`` = c^2 >= every squared norm
    (docs/index.md, MIPS to L2 transform); used to pick parents during construction.
    """
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    ea = (msq - a64.pow(2).sum(-1)).clamp_min(0.0).sqrt()
    eb = (msq - b64.pow(2).sum(-1)).clamp_min(0.0).sqrt()
    d = msq - a64 @ b64.T - ea[:, None] * eb[None, :]
    return d.clamp_min(0.0).to(a.dtype)
