"""Published measurements the simulator is calibrated on or checked against (the IceCache paper).

Only what the paper reports is stored here, each with where it comes from; settings the paper does not state
(budget, page size, dense layers of the latency runs) are marked as assumptions. Which anchor is used to fit
which constant, and which ones are only checked, is listed in `USES` and in the hardware module.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER = "IceCache paper (ICLR 2026, arXiv 2604.10539), latency section; as summarised in docs/simulator_anchors.md, Paper anchors"


@dataclass(frozen=True)
class BreakdownAnchor:
    """A published per-token latency breakdown of IceCache at one configuration.

    Attributes are seconds per output token unless named otherwise; ``assumed`` lists the settings that the
    paper does not state and that we fill in with the project defaults.
    """

    name: str
    hardware: str
    model: str
    context: int
    threads: int
    budget: int
    page_size: int
    dense_layers: int
    select_s: float
    decode_s: float
    load_s: float
    other_s: float
    tpot_s: float
    tpot_reuse_s: float
    tt2t_s: float
    tt2t_reuse_s: float
    assumed: tuple[str, ...]
    source: str
    #: layers per selection of the ``icecache-r`` prediction (the paper does not say; 4 assumed, see ``assumed``)
    reuse_every: int = 4


@dataclass(frozen=True)
class LineAnchor:
    """A straight line ``TPOT = intercept_s + slope_s_per_token * context`` read off the paper's figure."""

    name: str
    hardware: str
    model: str
    variant: str
    intercept_s: float
    slope_s_per_token: float
    source: str

    def tpot_s(self, context: float) -> float:
        return self.intercept_s + self.slope_s_per_token * context


#: A100, Llama-3.1-8B, 36k tokens, 64 CPU threads: TPOT 0.11 s = DCI 0.05 + decoding 0.04 + loading 0.015 +
#: other 0.005; 0.06 s with layer reuse. Time to second token 7.7 s (5.9 s with reuse).
PAPER_A100_36K = BreakdownAnchor(
    name="paper-a100-36k",
    hardware="a100-80gb-pcie",
    model="llama-3.1-8b",
    context=36_000,
    threads=64,
    budget=256,
    page_size=16,
    dense_layers=2,
    select_s=0.05,
    decode_s=0.04,
    load_s=0.015,
    other_s=0.005,
    tpot_s=0.11,
    tpot_reuse_s=0.06,
    tt2t_s=7.7,
    tt2t_reuse_s=5.9,
    assumed=("budget=256", "page_size=16", "dense_layers=2", "reuse layers r unknown"),
    source=PAPER,
)

#: H100, Qwen3-4B: per-token decode latency vs context (n in tokens), lines through the paper's two points
#: (docs/simulator_anchors.md, Paper anchors: full 30 + 1.07 n, IceCache 183 + 0.30 n, reuse 123 + 0.10 n; ms with n in k-tokens).
PAPER_H100_QWEN3_FULL = LineAnchor(
    "paper-h100-qwen3-full", "h100-sxm", "qwen3-4b", "full", 0.030, 1.07e-6, PAPER + "; line fit"
)
PAPER_H100_QWEN3_ICECACHE = LineAnchor(
    "paper-h100-qwen3-icecache", "h100-sxm", "qwen3-4b", "icecache", 0.183, 0.30e-6, PAPER + "; line fit"
)
PAPER_H100_QWEN3_REUSE = LineAnchor(
    "paper-h100-qwen3-reuse", "h100-sxm", "qwen3-4b", "icecache-r", 0.123, 0.10e-6, PAPER + "; line fit"
)


def line_crossover_tokens(a: LineAnchor, b: LineAnchor) -> float:
    """Context where two lines cross (``inf`` when parallel)."""
    ds = a.slope_s_per_token - b.slope_s_per_token
    return float("inf") if ds == 0 else (b.intercept_s - a.intercept_s) / ds


#: Which anchor feeds which constant (everything else in the paper is a check, never an input).
USES: dict[str, str] = {
    PAPER_H100_QWEN3_FULL.name: "fits the device decode constants (attention bandwidth efficiency, per-layer overhead)",
    PAPER_A100_36K.name: "fits the host time scale of index work (its DCI 0.05 s only); decode, load, other, TT2T are checks",
    PAPER_H100_QWEN3_ICECACHE.name: "check only (the crossover target)",
    PAPER_H100_QWEN3_REUSE.name: "check only",
}
