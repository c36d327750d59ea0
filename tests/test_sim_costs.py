"""Cost predictors, calibration profiles, hardware profiles and model shapes of the simulator."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.sim import anchors
from icecache.sim.closed_forms import lpt_makespan_s, transfer_time_s
from icecache.sim.hardware import (
    HARDWARE,
    canonical_hardware,
    derive_decode_constants,
    get_hardware,
    make_costs,
    resolve_host_scale,
)
from icecache.sim.predictors import ExtrapolationError, ExtrapolationWarning, Predictor, fit_predictor
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import SHAPES, ModelShape, get_shape
from icecache.sim.testing import synthetic_profile


# ------------------------------------------------------------------------------------------- closed forms
def test_transfer_time_is_alpha_per_call_plus_bytes_over_bandwidth():
    assert transfer_time_s(25e6, 4, 5e-6, 25e9) == pytest.approx(4 * 5e-6 + 1e-3)
    assert transfer_time_s(0, 0, 5e-6, 25e9) == 0.0
    with pytest.raises(ConfigError):
        transfer_time_s(-1, 1, 0, 1)
    with pytest.raises(ConfigError):
        transfer_time_s(1, 1, 0, 0)


def test_lpt_makespan():
    assert lpt_makespan_s([3, 3, 2, 2, 2], 2) == 7
    assert lpt_makespan_s([1.0] * 8, 8) == 1.0
    assert lpt_makespan_s([], 4) == 0.0


# ------------------------------------------------------------------------------------------- predictors
pos = st.floats(min_value=1e-6, max_value=1e-2)


@settings(max_examples=20)
@given(a=pos, b=st.floats(min_value=1e-9, max_value=1e-5))
def test_affine_fit_recovers_exact_parameters(a, b):
    x = np.array([[128.0], [512.0], [2048.0], [8192.0]])
    p = fit_predictor("t", "affine", ["n"], x, a + b * x[:, 0])
    assert p.params[0] == pytest.approx(a, rel=1e-4, abs=1e-12)
    assert p.params[1] == pytest.approx(b, rel=1e-4)
    assert p.fit_mape < 1e-6
    assert (p.lo, p.hi) == ((128.0,), (8192.0,))


def test_quadratic_and_power_fits_recover_exact_parameters():
    x = np.array([128.0, 256.0, 512.0, 1024.0, 2048.0])
    q = fit_predictor("p", "quadratic", ["n"], x[:, None], 0.01 + 1e-4 * x + 1e-8 * x**2)
    assert q.params == pytest.approx((0.01, 1e-4, 1e-8), rel=1e-4)
    X = np.array([[n, b] for n in (1024.0, 4096.0, 16384.0, 65536.0) for b in (64.0, 256.0)])
    y = 2e-4 + 3e-7 * X[:, 0] ** 0.7 * X[:, 1] ** 0.2
    pw = fit_predictor("s", "power", ["n", "budget"], X, y)
    assert pw.fit_mape < 1e-3
    assert pw.params[2] == pytest.approx(0.7, abs=0.02) and pw.params[3] == pytest.approx(0.2, abs=0.02)


def test_fit_rejects_empty_or_nonpositive_timings():
    with pytest.raises(ConfigError):
        fit_predictor("t", "affine", ["n"], np.zeros((0, 1)), [])
    with pytest.raises(ConfigError):
        fit_predictor("t", "affine", ["n"], [[1.0]], [0.0])
    with pytest.raises(ConfigError):
        fit_predictor("t", "cubic", ["n"], [[1.0]], [1.0])


def test_extrapolation_policies():
    p = Predictor("select/x", "affine", ("n",), (1e-3, 1e-6), (1000.0,), (10_000.0,))
    notes: list[str] = []
    assert p.predict([5000], "refuse", notes) == pytest.approx(1e-3 + 5e-3)
    assert notes == []
    with pytest.raises(ExtrapolationError, match="outside measured"):
        p.predict([50_000], "refuse")
    with pytest.warns(ExtrapolationWarning):
        p.predict([50_000], "warn", notes)
    assert len(notes) == 1 and "n=50000" in notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert p.predict([50_000], "allow") == pytest.approx(1e-3 + 5e-2)
    assert isinstance(ExtrapolationError("x"), ConfigError)


# ------------------------------------------------------------------------------------------- profiles
def test_profile_round_trip_reads_without_checking_the_stack(tmp_path):
    """The simulator reads a profile as a file; whether it still fits the running stack is `icecache calibrate
    --check`'s question (tests/test_measure_calibrate.py), so reading one measured elsewhere warns nothing."""
    prof = synthetic_profile()
    path = prof.save(tmp_path / "p.json")
    back = CalibrationProfile.load(path)
    assert back.predictors == prof.predictors and back.meta == prof.meta
    d = json.loads(path.read_text())
    d["versions"]["torch"] = "0.0.1"
    d["pager_hashes"] = {"hnsw": "0" * 16, "gone": "1" * 16}
    path.write_text(json.dumps(d))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CalibrationProfile.load(path).versions["torch"] == "0.0.1"
    with pytest.raises(ConfigError, match="calibrate"):
        CalibrationProfile.load(tmp_path / "missing.json")
    for text, msg in (("{not json", "not JSON"), ("[1, 2]", "JSON object"), (json.dumps({**d, "schema": 7}), "schema"),
                      (json.dumps({k: v for k, v in d.items() if k != "predictors"}), "predictors")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            CalibrationProfile.load(path)


def test_the_shipped_profile_is_package_data():
    from icecache.sim.profile import default_profile_path, default_runs_path

    assert default_profile_path().is_file() and default_runs_path().is_file()
    assert "experiments" not in default_profile_path().parts
    assert {"select/mdci", "select/sequential"} <= set(CalibrationProfile.load(default_profile_path()).predictors)


def test_profile_names_missing_predictors():
    prof = synthetic_profile(pagers=("sequential",))
    costs = make_costs(get_hardware("this-machine", prof), prof)
    with pytest.raises(ConfigError, match="mdci"):
        costs.select_job_s(get_shape("smollm2"), "mdci", 4000, 256, 16)


def test_measured_costs_decompose_the_step_without_new_assumptions():
    prof = synthetic_profile()
    c = make_costs(get_hardware("this-machine", prof), prof, "allow")
    s = get_shape("smollm2")
    # full-KV step = layers x (compute + in-model attention) + head, and equals the measured step line
    for n in (512, 4096):
        step = s.layers * (c.layer_compute_s(s) + c.attend_s(s, n, in_model=True)) + c.head_s(s)
        assert step == pytest.approx(0.030 + 2e-6 * n, rel=1e-9)
    assert c.attend_s(s, 1000, in_model=False) == pytest.approx(1e-5 + 5e-8 * 1000)


def test_sparse_attend_uses_the_runtime_kernel_timing_when_measured():
    import dataclasses

    prof = synthetic_profile()
    kernel = Predictor(name="sparse_attention", form="affine", features=("slots",), params=(3e-6, 2e-8), lo=(96.0,), hi=(1536.0,),
                       fit_mape=0.0, n_points=0)
    prof = dataclasses.replace(prof, predictors={**prof.predictors, "sparse_attention": kernel})
    c = make_costs(get_hardware("this-machine", prof), prof, "allow")
    notes: list[str] = []
    assert c.attend_s(get_shape("smollm2"), 324, in_model=False, notes=notes) == pytest.approx(3e-6 + 2e-8 * 324)
    assert not any("sparse attention" in n for n in notes)
    # full/dense layers keep the model's own attention
    assert c.attend_s(get_shape("smollm2"), 4096, in_model=True) == pytest.approx(
        synthetic_profile().predictors["attention"].params[0] + 2e-6 / 30 * 4096)
    # another shape: the kernel's work scales with query heads x head width
    g = get_shape("llama-3.1-8b")
    ratio = (g.q_heads * g.head_dim) / (9 * 64)
    assert c.attend_s(g, 324, in_model=False) == pytest.approx(3e-6 + 2e-8 * 324 * ratio)


# ------------------------------------------------------------------------------------------- hardware
def test_every_constant_has_a_unit_a_source_and_a_flag():
    for hw in HARDWARE.values():
        consts = list(hw.constants())
        assert len(consts) >= 15
        for path, q in consts:
            assert q.unit and len(q.source) > 10, path
            assert isinstance(q.calibrated, bool)
    assert get_hardware("h100").device.attn_bw_efficiency.calibrated
    assert not get_hardware("a100").device.attn_bw_efficiency.calibrated


def test_hardware_names_and_errors():
    assert canonical_hardware("A100") == "a100-80gb-pcie"
    assert canonical_hardware("h200-gen5") == "h200"
    with pytest.raises(UnknownNameError, match="a100-80gb-pcie"):
        get_hardware("tpu")
    with pytest.raises(ConfigError, match="calibration profile"):
        get_hardware("this-machine")


def test_decode_constants_derivation_round_trips():
    line = anchors.PAPER_H100_QWEN3_FULL
    shape = get_shape("qwen3-4b")
    eff, ovh = derive_decode_constants(line, shape, 3.35e12, 2.9e12, 2)
    assert 0.02 < eff < 0.08 and 0.0003 < ovh < 0.002  # 4% of HBM; ~0.75 ms per layer: dispatch-bound decode
    slope = shape.kv_bytes_per_token(2) / (3.35e12 * eff)
    assert slope == pytest.approx(line.slope_s_per_token)
    with pytest.raises(ConfigError):
        derive_decode_constants(anchors.LineAnchor("x", "h", "m", "full", 0.001, 1e-6, "s"), shape, 3.35e12, 2.9e12, 2)


def test_host_scale_without_mdci_stays_one_and_says_so():
    prof = synthetic_profile(pagers=("sequential",))
    scale, why = resolve_host_scale(get_hardware("a100"), make_costs(get_hardware("this-machine", prof), prof))
    assert scale == 1.0 and "mdci" in why


def test_paper_line_crossover_is_about_200k():
    x = anchors.line_crossover_tokens(anchors.PAPER_H100_QWEN3_FULL, anchors.PAPER_H100_QWEN3_ICECACHE)
    assert 190_000 < x < 210_000


# ------------------------------------------------------------------------------------------- shapes
def test_parameter_counts_derived_from_the_shapes():
    published = {"llama-3.1-8b": 8.03e9, "mistral-7b": 7.25e9, "qwen3-4b": 4.02e9, "smollm2-135m-instruct": 134.5e6}
    for name, n in published.items():
        assert SHAPES[name].total_params() == pytest.approx(n, rel=0.005), name
    assert get_shape("llama-3.1-8b").kv_bytes_per_token(2) == 128 * 1024
    assert get_shape("qwen3-4b").kv_bytes_per_token(2) == 144 * 1024


def test_shape_errors():
    with pytest.raises(UnknownNameError, match="llama-3.1-8b"):
        get_shape("llama-9")
    with pytest.raises(ConfigError):
        ModelShape("x", 2, 9, 4, 64, 576, 1536, 100, True, False, 1024, "s")
    with pytest.raises(ConfigError):
        ModelShape("x", 0, 8, 4, 64, 576, 1536, 100, True, False, 1024, "s")


@pytest.mark.model
def test_embedded_model_shape_matches_the_loaded_model(smollm2):
    model, _ = smollm2
    s, c = get_shape("smollm2"), model.config
    assert (s.layers, s.q_heads, s.kv_heads, s.head_dim, s.hidden, s.intermediate, s.vocab) == (
        c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size)
    assert s.total_params() == sum(p.numel() for p in model.parameters())
    assert math.isclose(s.total_params(), 134_515_008)


def test_piecewise_power_follows_a_kinked_curve_and_extends_its_last_segment():
    ns = [1024.0, 4096.0, 16384.0, 65536.0, 262144.0]
    flat_then_linear = {n: 3e-4 if n <= 16384 else 3e-4 * n / 16384 for n in ns}
    X = np.array([[n, b] for n in ns for b in (64.0, 256.0)])
    y = np.array([flat_then_linear[n] * (b / 64) ** 0.25 for n, b in X])
    p = fit_predictor("select/k", "pwpower", ["n", "budget"], X, y)
    assert p.fit_mape < 1e-9
    assert p.formula([8000.0, 64.0]) == pytest.approx(3e-4, rel=1e-9)  # inside the flat part
    assert p.formula([1_048_576.0, 64.0]) == pytest.approx(3e-4 * 64, rel=1e-6)  # last segment is linear: continues
    assert p.formula([65536.0, 128.0]) == pytest.approx(1.2e-3 * 2**0.25, rel=1e-6)
    assert Predictor.from_dict(p.to_dict()) == p


def test_prefill_job_counts_host_store_writes_when_measured():
    import dataclasses

    prof = synthetic_profile()
    s = get_shape("smollm2")
    c0 = make_costs(get_hardware("this-machine", prof), prof, "allow")
    notes: list[str] = []
    build = c0.build_job_s(s, "mdci", 4096, 16, notes)
    assert build == pytest.approx(1e-3 + 1e-6 * 4096 ** 1.1) and any("host-store writes" in n for n in notes)
    sync = Predictor(name="store_sync", form="affine", features=("tokens",), params=(2e-4, 1e-6), lo=(1024.0,), hi=(16384.0,),
                     fit_mape=0.0, n_points=0)
    prof = dataclasses.replace(prof, predictors={**prof.predictors, "store_sync": sync})
    c1 = make_costs(get_hardware("this-machine", prof), prof, "allow")
    assert c1.build_job_s(s, "mdci", 4096, 16) == pytest.approx(build + 2e-4 + 1e-6 * 4096)
