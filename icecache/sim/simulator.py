"""`Simulator`: simulates configurations on any hardware with one calibration profile and one hit model."""

from __future__ import annotations

from icecache.sim.config import SimConfig
from icecache.sim.costs import CostModel
from icecache.sim.hardware import canonical_hardware, get_hardware, make_costs
from icecache.sim.hitrate import HitModel, PriorHitModel
from icecache.sim.model import SimResult, simulate
from icecache.sim.profile import CalibrationProfile

__all__ = ["Simulator"]


class Simulator:
    """Simulates configurations with one calibration profile and hit model; the cost model of each hardware
    is built once (`icecache.sim.hardware.make_costs`) and kept.

    Parameters
    ----------
    profile : CalibrationProfile or None
        Host-side measurements (every hardware needs one for its host costs).
    hit : HitModel, optional
        Page hit statistics (None: the prior, every selected page copied every step).
    extrapolation : {"refuse", "warn", "allow"}
        Policy of the cost predictors outside their measured ranges.
    """

    def __init__(self, profile: CalibrationProfile | None, hit: HitModel | None = None, extrapolation: str = "allow") -> None:
        self.profile = profile
        self.hit = hit or PriorHitModel()
        self.extrapolation = extrapolation
        self._costs: dict[str, CostModel] = {}

    def costs(self, hardware: str) -> CostModel:
        """The cost model of ``hardware`` (a name or alias)."""
        key = canonical_hardware(hardware)
        if key not in self._costs:
            hw = get_hardware(key, self.profile)
            self._costs[key] = make_costs(hw, self.profile, self.extrapolation)
        return self._costs[key]

    def with_costs(self, hardware: str, costs: CostModel) -> Simulator:
        """A simulator like this one whose ``hardware`` answers from ``costs`` (a what-if)."""
        alt = Simulator(self.profile, self.hit, self.extrapolation)
        alt._costs = {**self._costs, canonical_hardware(hardware): costs}
        return alt

    def run(self, cfg: SimConfig, fine: bool = False, with_prefill: bool = True) -> SimResult:
        """`icecache.sim.model.simulate` of ``cfg`` on its hardware's cost model."""
        return simulate(cfg, self.costs(cfg.hardware), self.hit, fine=fine, with_prefill=with_prefill)
