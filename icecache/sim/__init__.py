"""IceCache timing simulator: calibrated cost predictors + a SimPy model of prefill and decode.

    python -m icecache.sim calibrate        # time this machine's components, write a profile
    python -m icecache.sim sweep ...        # project TPOT / TT2T / bytes over hardware, models, contexts
    python -m icecache.sim validate ...     # score predictions against measured runs of the runtime

Modules: `shapes` (model shapes), `hardware` (profiles with sources), `anchors` (the paper's numbers),
`costs` (closed forms, fitted predictors, cost models), `calibrate`, `hitrate` (traces, hit models),
`model` (SimPy engine), `sweep`, `validate`. The simulator never imports the runtime's internals.
"""

from icecache.sim.costs import CalibrationProfile, GpuCosts, MeasuredCosts, Predictor
from icecache.sim.hardware import HARDWARE, HardwareProfile, Quantity, get_hardware, make_costs
from icecache.sim.hitrate import HitStats, ParametricHitModel, PriorHitModel, Trace, read_trace, synthetic_trace
from icecache.sim.model import VARIANTS, SimConfig, SimResult, simulate
from icecache.sim.shapes import SHAPES, ModelShape, get_shape

__all__ = [
    "CalibrationProfile", "GpuCosts", "MeasuredCosts", "Predictor",
    "HARDWARE", "HardwareProfile", "Quantity", "get_hardware", "make_costs",
    "HitStats", "ParametricHitModel", "PriorHitModel", "Trace", "read_trace", "synthetic_trace",
    "VARIANTS", "SimConfig", "SimResult", "simulate",
    "SHAPES", "ModelShape", "get_shape",
]
