"""IceCache timing simulator: calibrated cost predictors + a SimPy model of prefill and decode.

    python -m icecache.sim sweep ... --out DIR   # project TPOT / TT2T / bytes over hardware, models, contexts
    python -m icecache.sim validate              # score predictions against the shipped measured runs
    icecache calibrate --out PROFILE.json        # time this machine's components (the measure package)

Modules, bottom up: `shapes` (model shapes), `anchors` (the paper's numbers), `closed_forms`, `predictors`
(fitted formulas), `profile` (the calibration profile file), `costs` (the `CostModel` interface),
`cost_models` (its two implementations), `hardware` (profiles with sources), `hitrate` (traces, hit models), `config` (`SimConfig`),
`plans`, `engine` (SimPy), `model` (`simulate`), `simulator`, `sweep`, `crossover`, `reports`, `validate`,
`inputs` and `cli` (the commands). The simulator imports only `icecache.core` and itself: profiles are files it
reads; the measure package (``icecache calibrate``) makes them.
"""

from icecache.sim.config import VARIANTS, SimConfig
from icecache.sim.cost_models import GpuCosts, MeasuredCosts
from icecache.sim.costs import CostModel
from icecache.sim.hardware import HARDWARE, HardwareProfile, Quantity, get_hardware, make_costs
from icecache.sim.hitrate import HitStats, ParametricHitModel, PriorHitModel, Trace, read_trace, synthetic_trace
from icecache.sim.model import SimResult, simulate
from icecache.sim.predictors import Predictor
from icecache.sim.profile import CalibrationProfile, default_profile_path, default_runs_path
from icecache.sim.shapes import SHAPES, ModelShape, get_shape
from icecache.sim.simulator import Simulator

__all__ = [
    "CalibrationProfile", "default_profile_path", "default_runs_path", "CostModel", "GpuCosts", "MeasuredCosts", "Predictor",
    "HARDWARE", "HardwareProfile", "Quantity", "get_hardware", "make_costs",
    "HitStats", "ParametricHitModel", "PriorHitModel", "Trace", "read_trace", "synthetic_trace",
    "VARIANTS", "SimConfig", "SimResult", "simulate", "Simulator",
    "SHAPES", "ModelShape", "get_shape",
]
