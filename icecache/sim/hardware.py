"""Hardware profiles: every constant with its unit, its source, and whether it was calibrated.

Three GPU servers (A100-80GB PCIe on Gen4, H100 SXM and H200 on Gen5) and the machine the calibration ran on
(``this-machine``: no GPU, the CPU runs everything, built from a calibration profile). A `Quantity` is
*calibrated* when it was fitted to, or measured in, timings of an LLM decode or of the transfer itself; a
spec-sheet figure or an assumption is not.

Device decode constants (attention bandwidth efficiency, per-layer overhead) are fitted, in code below, to
the paper's H100 full-KV line (`icecache.sim.anchors`); the same values are carried over to the A100 and
H200 (not calibrated there). Host index work is this machine's measurement times a host time scale that is
fitted to the paper's A100 DCI time when a profile with the ``mdci`` pager is at hand (`resolve_host_scale`).

    >>> from icecache.sim.hardware import get_hardware
    >>> hw = get_hardware("h100")
    >>> hw.link.h2d_Bps.value
    51000000000.0
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.sim import anchors
from icecache.sim.cost_models import GpuCosts, MeasuredCosts
from icecache.sim.costs import CostModel
from icecache.sim.predictors import check_policy
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import ModelShape, get_shape


@dataclass(frozen=True)
class Quantity:
    """A constant with its unit, where it comes from, and whether it was calibrated on measured timings."""

    value: float
    unit: str
    source: str
    calibrated: bool

    def __post_init__(self) -> None:
        if not isinstance(self.value, (int, float)) or math.isnan(self.value) or self.value < 0:
            raise ConfigError(f"Quantity value must be a number >= 0, got {self.value!r} ({self.source})")


@dataclass(frozen=True)
class DeviceSpec:
    """An accelerator: memory, bandwidth, compute, and the decode implementation's fitted constants."""

    memory_bytes: Quantity
    hbm_peak_Bps: Quantity
    hbm_achieved_Bps: Quantity
    peak_flops: Quantity
    prefill_mfu: Quantity
    attn_bw_efficiency: Quantity
    layer_overhead_s: Quantity
    step_overhead_s: Quantity
    kernel_launch_s: Quantity


@dataclass(frozen=True)
class LinkSpec:
    """Host <-> device link (pinned memory, copy engine)."""

    h2d_Bps: Quantity
    h2d_alpha_s: Quantity
    d2h_Bps: Quantity
    d2h_alpha_s: Quantity


@dataclass(frozen=True)
class HostSpec:
    """The host CPU that runs index work and the page gather.

    ``time_scale`` multiplies the measured index costs (select/build/insert); when it is None the scale is
    fitted to ``time_scale_anchor`` (see `resolve_host_scale`).
    """

    threads: Quantity
    pool_efficiency: Quantity
    gather_scale: Quantity
    time_scale: Quantity | None
    time_scale_anchor: str | None = None


@dataclass(frozen=True)
class HardwareProfile:
    """One machine. ``device`` and ``link`` are None for a CPU-only machine (costs measured there)."""

    name: str
    description: str
    device: DeviceSpec | None
    link: LinkSpec | None
    host: HostSpec
    kv_dtype_bytes: int
    shared_host_device: bool = False

    def constants(self) -> Iterator[tuple[str, Quantity]]:
        """Every `Quantity` of the profile with a dotted path (``"link.h2d_Bps"``)."""

        def walk(obj: Any, prefix: str) -> Iterator[tuple[str, Quantity]]:
            for f in fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, Quantity):
                    yield prefix + f.name, v
                elif is_dataclass(v):
                    yield from walk(v, prefix + f.name + ".")

        yield from walk(self, "")


# ------------------------------------------------------------------------------------------- derivations
def derive_decode_constants(
    line: anchors.LineAnchor, shape: ModelShape, hbm_peak_Bps: float, hbm_achieved_Bps: float, dtype_bytes: int
) -> tuple[float, float]:
    """Fit (attention bandwidth efficiency, per-layer overhead in s) to a measured full-KV TPOT line.

    The slope is attention reading every token's K and V in every layer:
    ``slope = kv_bytes_per_token / (peak * efficiency)``. The intercept is the step without context:
    ``intercept = layers * (overhead + layer weight bytes / achieved) + head weight bytes / achieved``.
    """
    eff = shape.kv_bytes_per_token(dtype_bytes) / (line.slope_s_per_token * hbm_peak_Bps)
    weights_s = (shape.layers * shape.layer_params() + shape.head_params()) * dtype_bytes / hbm_achieved_Bps
    overhead = (line.intercept_s - weights_s) / shape.layers
    if not (0 < eff <= 1) or overhead < 0:
        raise ConfigError(f"anchor {line.name} gives efficiency {eff:.3g} and overhead {overhead:.3g} s: inconsistent")
    return eff, overhead


_H100_PEAK = 3.35e12
_H100_ACHIEVED = 2.90e12
_EFF, _OVERHEAD = derive_decode_constants(
    anchors.PAPER_H100_QWEN3_FULL, get_shape(anchors.PAPER_H100_QWEN3_FULL.model), _H100_PEAK, _H100_ACHIEVED, 2
)
_FIT_SRC = (
    f"fitted to {anchors.PAPER_H100_QWEN3_FULL.name} (full-KV TPOT line, Qwen3-4B bf16, H100) with "
    "derive_decode_constants; HF transformers decode, not a roofline"
)


def _decode_constants(on_h100: bool) -> dict[str, Quantity]:
    where = "" if on_h100 else "; carried over from the H100 fit (same software stack assumed)"
    return dict(
        attn_bw_efficiency=Quantity(_EFF, "fraction of peak HBM bandwidth", _FIT_SRC + where, on_h100),
        layer_overhead_s=Quantity(_OVERHEAD, "s per layer per step", _FIT_SRC + where, on_h100),
        step_overhead_s=Quantity(0.0, "s per step", "assumption: no host overhead beyond the modelled stages", False),
        kernel_launch_s=Quantity(10e-6, "s per kernel", "assumption: PyTorch launch of a small kernel, 5-10 us", False),
        prefill_mfu=Quantity(0.5, "fraction of peak FLOP/s", "assumption: prefill model-FLOPs utilisation", False),
    )


def _host(threads: int) -> HostSpec:
    return HostSpec(
        threads=Quantity(threads, "threads", "the paper's setting (64 CPU threads)", False),
        pool_efficiency=Quantity(1.0, "fraction", "assumption: index jobs of different heads scale perfectly", False),
        gather_scale=Quantity(1.0, "x this machine", "assumption: page gather as fast as measured on this machine", False),
        time_scale=None,
        time_scale_anchor=anchors.PAPER_A100_36K.name,
    )


_GEN4 = LinkSpec(
    h2d_Bps=Quantity(25e9, "B/s", "pinned H2D on PCIe Gen4 x16: 25.13 GB/s A100 (NVIDIA/nvbandwidth#42), 26.28 Azure ND A100 v4", True),
    h2d_alpha_s=Quantity(5e-6, "s per call", "cudaMemcpyAsync setup 2-4 us + framework (FlexKV PR#193, torchcomms PR#2195)", False),
    d2h_Bps=Quantity(25e9, "B/s", "assumed symmetric with H2D on Gen4", False),
    d2h_alpha_s=Quantity(5e-6, "s per call", "assumed equal to the H2D per-call cost", False),
)
_GEN5_H100 = LinkSpec(
    h2d_Bps=Quantity(51e9, "B/s", "Azure ND H100 v5 pinned H2D (AI-benchmarking-guide)", True),
    h2d_alpha_s=Quantity(5e-6, "s per call", "cudaMemcpyAsync setup 2-4 us + framework (FlexKV PR#193, torchcomms PR#2195)", False),
    d2h_Bps=Quantity(52e9, "B/s", "Azure ND H100 v5 pinned D2H", True),
    d2h_alpha_s=Quantity(5e-6, "s per call", "assumed equal to the H2D per-call cost", False),
)
_GEN5_H200 = replace(
    _GEN5_H100,
    h2d_Bps=Quantity(52e9, "B/s", "Azure ND H200 v5 pinned H2D (AI-benchmarking-guide)", True),
    d2h_Bps=Quantity(52e9, "B/s", "Azure ND H200 v5 pinned D2H", True),
)

#: The GPU servers (names are registry keys; see `ALIASES` for short names).
HARDWARE: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            name="a100-80gb-pcie",
            description="NVIDIA A100 80GB PCIe, PCIe Gen4 x16 host link",
            device=DeviceSpec(
                memory_bytes=Quantity(80e9, "B", "NVIDIA A100 datasheet (80 GB HBM2e)", False),
                hbm_peak_Bps=Quantity(1.935e12, "B/s", "NVIDIA A100 datasheet, PCIe 80GB: 1,935 GB/s", False),
                hbm_achieved_Bps=Quantity(0.79 * 1.935e12, "B/s", "79% of peak, the copy efficiency measured on ND A100 v4 (1.61 of 2.04 TB/s)", False),
                peak_flops=Quantity(312e12, "FLOP/s", "NVIDIA A100 datasheet, bf16 dense", False),
                **_decode_constants(on_h100=False),
            ),
            link=_GEN4,
            host=_host(anchors.PAPER_A100_36K.threads),
            kv_dtype_bytes=2,
        ),
        HardwareProfile(
            name="h100-sxm",
            description="NVIDIA H100 SXM 80GB, PCIe Gen5 x16 host link",
            device=DeviceSpec(
                memory_bytes=Quantity(80e9, "B", "NVIDIA H100 SXM datasheet (80 GB HBM3)", False),
                hbm_peak_Bps=Quantity(_H100_PEAK, "B/s", "NVIDIA H100 SXM datasheet: 3.35 TB/s", False),
                hbm_achieved_Bps=Quantity(_H100_ACHIEVED, "B/s", "Azure ND H100 v5 measured copy 2.90 TB/s (87%)", True),
                peak_flops=Quantity(989e12, "FLOP/s", "NVIDIA H100 SXM datasheet, bf16 dense", False),
                **_decode_constants(on_h100=True),
            ),
            link=_GEN5_H100,
            host=_host(anchors.PAPER_A100_36K.threads),
            kv_dtype_bytes=2,
        ),
        HardwareProfile(
            name="h200",
            description="NVIDIA H200 141GB (SXM), PCIe Gen5 x16 host link",
            device=DeviceSpec(
                memory_bytes=Quantity(141e9, "B", "NVIDIA H200 datasheet (141 GB HBM3e)", False),
                hbm_peak_Bps=Quantity(4.8e12, "B/s", "NVIDIA H200 datasheet: 4.8 TB/s", False),
                hbm_achieved_Bps=Quantity(4.01e12, "B/s", "Azure ND H200 v5 measured copy 4.01 TB/s (84%)", True),
                peak_flops=Quantity(989e12, "FLOP/s", "NVIDIA H200 datasheet: same compute as H100 SXM, bf16 dense", False),
                **_decode_constants(on_h100=False),
            ),
            link=_GEN5_H200,
            host=_host(anchors.PAPER_A100_36K.threads),
            kv_dtype_bytes=2,
        ),
    )
}

THIS_MACHINE = "this-machine"
ALIASES: dict[str, str] = {"a100": "a100-80gb-pcie", "a100-80gb": "a100-80gb-pcie", "h100": "h100-sxm", "h200-gen5": "h200"}


def hardware_names() -> list[str]:
    """Every accepted hardware name (registry keys and ``this-machine``)."""
    return sorted(HARDWARE) + [THIS_MACHINE]


def canonical_hardware(name: str) -> str:
    """Resolve an alias; raise `UnknownNameError` listing the known names."""
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key in HARDWARE or key == THIS_MACHINE:
        return key
    raise UnknownNameError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())} (aliases: a100, h100, h200)")


def this_machine(profile: Any) -> HardwareProfile:
    """The CPU machine a `CalibrationProfile` was measured on, as a hardware profile."""
    m = profile.machine
    src = f"calibration profile of {m.get('cpu_model', 'this machine')}, {profile.created}"
    return HardwareProfile(
        name=THIS_MACHINE,
        description=f"{m.get('cpu_model', 'CPU')} ({m.get('cpu_count')} threads), no GPU: the CPU is the device",
        device=None,
        link=None,
        host=HostSpec(
            threads=Quantity(float(m.get("cpu_count", 1)), "threads", src, True),
            pool_efficiency=Quantity(1.0, "fraction", src + " (per thread count, see meta.pool_efficiency)", True),
            gather_scale=Quantity(1.0, "x", "measured here", True),
            time_scale=Quantity(1.0, "x", "measured here", True),
        ),
        kv_dtype_bytes=int(profile.meta.get("dtype_bytes", 4)),
        shared_host_device=True,
    )


def get_hardware(name: str, profile: Any = None) -> HardwareProfile:
    """The hardware profile ``name``; ``this-machine`` needs the calibration ``profile``."""
    key = canonical_hardware(name)
    if key == THIS_MACHINE:
        if profile is None:
            raise ConfigError("hardware 'this-machine' needs a calibration profile (icecache calibrate)")
        return this_machine(profile)
    return HARDWARE[key]


def resolve_host_scale(hw: HardwareProfile, host_costs: MeasuredCosts, pager: str = "mdci") -> tuple[float, str]:
    """The host time scale of ``hw`` (index work time relative to the measured host) and how it was set.

    When the profile names an anchor, the scale makes the predicted DCI time of the anchor configuration
    equal the published one: ``scale = (anchor select s / sparse layers / rounds) / measured select job s``,
    rounds = ceil(KV heads / threads). Without a measured ``pager`` the scale stays 1 (said in the text).
    """
    if hw.host.time_scale is not None:
        return float(hw.host.time_scale.value), hw.host.time_scale.source
    anchor = {anchors.PAPER_A100_36K.name: anchors.PAPER_A100_36K}[hw.host.time_scale_anchor or ""]
    if f"select/{pager}" not in host_costs.profile.predictors:
        return 1.0, f"1.0: pager {pager!r} not in the calibration profile, so {anchor.name} cannot fit the host scale"
    shape = get_shape(anchor.model)
    sparse = shape.layers - anchor.dense_layers
    rounds = math.ceil(shape.kv_heads / anchor.threads)
    n_mid = anchor.context - 4 - 64
    notes: list[str] = []
    quiet = MeasuredCosts(host_costs.profile, extrapolation="allow")
    t_here = quiet.select_job_s(shape, pager, n_mid, anchor.budget, anchor.page_size, notes)
    t_paper = anchor.select_s / sparse / rounds
    scale = t_paper / t_here
    extra = f" (measured range exceeded: {'; '.join(notes)})" if notes else ""
    return scale, (
        f"{scale:.3g}: fitted so that {pager} select at {anchor.name} ({anchor.model}, {anchor.context} tokens, "
        f"{anchor.threads} threads) takes the published {anchor.select_s} s{extra}"
    )


def make_costs(hw: HardwareProfile, profile: CalibrationProfile | None, extrapolation: str = "warn", scale_pager: str = "mdci") -> CostModel:
    """The cost model of ``hw``: `MeasuredCosts` for this machine, `GpuCosts` for a GPU server."""
    check_policy(extrapolation)
    if profile is None:
        raise ConfigError(
            f"hardware {hw.name!r} needs a calibration profile for its host-side costs; run "
            "`icecache calibrate` (or pass --profile)"
        )
    host = MeasuredCosts(profile, extrapolation=extrapolation)
    if hw.device is None:
        return host
    scale, _ = resolve_host_scale(hw, host, scale_pager)
    return GpuCosts(hardware=hw, host=host, host_time_scale=scale)
