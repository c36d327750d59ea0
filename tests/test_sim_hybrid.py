"""Hybrid models in the simulator: sliding-window layers (Gemma 3) next to the global layers IceCache runs on."""

from __future__ import annotations

import dataclasses

import pytest

from icecache.core.errors import ConfigError
from icecache.sim.config import SimConfig, layer_roles
from icecache.sim.hardware import get_hardware, make_costs
from icecache.sim.hitrate import HitStats
from icecache.sim.model import device_kv_bytes_by_role, simulate
from icecache.sim.plans import plan_prefill
from icecache.sim.shapes import get_shape, register_shape, shape_from_config, shape_from_dict, shape_to_dict
from icecache.sim.testing import synthetic_profile

GEMMA = get_shape("gemma-3-270m")
#: the same model with every layer global (no sliding window), for the "nothing else changes" comparisons
ALL_GLOBAL = register_shape(dataclasses.replace(GEMMA, name="gemma-3-270m-all-global", sliding_layers=(), sliding_window=0))
#: a window longer than every context below: sliding layers then see exactly what global layers see
WIDE = register_shape(dataclasses.replace(GEMMA, name="gemma-3-270m-wide-window", sliding_window=1 << 20))


class Fixed:
    def __init__(self, h: float) -> None:
        self.h = h

    def predict(self, *a, **k):
        return HitStats(self.h, 1.0, 1.0, "fixed")


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile()


def _costs(hw, profile):
    return make_costs(get_hardware(hw, profile), profile, "allow")


def test_gemma_shape():
    assert GEMMA.global_layers == (5, 11, 17) and GEMMA.num_sliding == 15 and GEMMA.sliding_window == 512
    assert (GEMMA.q_heads, GEMMA.kv_heads, GEMMA.head_dim, GEMMA.hidden, GEMMA.intermediate, GEMMA.vocab) == (4, 1, 256, 640, 2048, 262144)
    # parameters derived from the shape; Google's model card: 170M embedding + 100M transformer parameters
    embed = GEMMA.vocab * GEMMA.hidden
    assert embed == pytest.approx(170e6, rel=0.02) and GEMMA.total_params() - embed == pytest.approx(100e6, rel=0.01)
    assert GEMMA.attended_tokens(5, 4096) == 4096 and GEMMA.attended_tokens(0, 4096) == 512 and GEMMA.attended_tokens(0, 100) == 100
    assert shape_from_dict(shape_to_dict(GEMMA)) == GEMMA


@pytest.mark.slow  # parsing the 250 MB file takes ~10 s
def test_gemma_parameter_count_matches_the_gguf_file():
    from icecache.runtime import models

    path = models.cache_root() / "gguf" / models.MODELS["gemma-3-270m"].filename
    if not path.is_file():
        pytest.skip("the Gemma GGUF has not been assembled on this machine (icecache.load_model('gemma-3-270m') does it)")
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(path))
    assert GEMMA.total_params() == sum(int(t.n_elements) for t in r.tensors)
    field = lambda k: int(r.fields[k].parts[r.fields[k].data[0]][0])
    assert field("gemma3.block_count") == GEMMA.layers and field("gemma3.attention.sliding_window") == GEMMA.sliding_window
    assert field("gemma3.attention.head_count_kv") == GEMMA.kv_heads and field("gemma3.attention.key_length") == GEMMA.head_dim


def test_shape_from_a_hybrid_transformers_config():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=32, hidden_size=64,
                           intermediate_size=128, vocab_size=256, sliding_window=16,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"])
    s = shape_from_config(cfg, "tiny-gemma")
    assert s.sliding_layers == (0, 1, 2, 3, 4) and s.sliding_window == 16 and s.norms_per_layer == 4 and s.qk_norm


@pytest.mark.parametrize("kw", [dict(sliding_layers=(0, 18)), dict(sliding_layers=(1, 1)), dict(sliding_window=0),
                                dict(sliding_layers=(), sliding_window=512), dict(sliding_layers=tuple(range(18)))])
def test_bad_sliding_layers_raise(kw):
    with pytest.raises(ConfigError):
        dataclasses.replace(GEMMA, **kw)


def test_without_sliding_layers_nothing_changes(profile):
    # a shape without sliding layers is the old ModelShape: every layer global, memory and roles as before
    llama = get_shape("llama-3.1-8b")
    assert llama.sliding_layers == () and llama.global_layers == tuple(range(32))
    assert llama.full_kv_bytes(1000, 2) == 1000 * llama.kv_bytes_per_token(2)
    assert layer_roles(llama, "icecache", (0, 1)) == ("dense",) * 2 + ("sparse",) * 30
    # and a window wider than the context makes full KV of the hybrid model the all-global model exactly
    costs = _costs("this-machine", profile)
    for n in (1000, 6000):
        a = simulate(SimConfig(WIDE.name, "this-machine", "full", n), costs)
        b = simulate(SimConfig(ALL_GLOBAL.name, "this-machine", "full", n), costs)
        assert (a.tpot_s, a.ttft_s, a.tt2t_s, a.device_kv_bytes, a.weights_bytes) == (b.tpot_s, b.ttft_s, b.tt2t_s, b.device_kv_bytes, b.weights_bytes)


def test_sliding_layers_attend_over_their_window_only(profile):
    costs = _costs("this-machine", profile)
    n = 6000
    hyb = simulate(SimConfig(GEMMA.name, "this-machine", "full", n, new_tokens=2), costs, with_prefill=False)
    glob = simulate(SimConfig(ALL_GLOBAL.name, "this-machine", "full", n, new_tokens=2), costs, with_prefill=False)
    ctx = n + 1  # decode context
    saved = 15 * (costs.attend_s(GEMMA, ctx, in_model=True) - costs.attend_s(GEMMA, 512, in_model=True))
    assert glob.tpot_s - hyb.tpot_s == pytest.approx(saved, rel=1e-9)
    assert hyb.stages["attend"] == 0 and hyb.stages["dense_attend"] > 0


def test_device_kv_of_sliding_layers_is_their_window(profile):
    per = GEMMA.kv_bytes_per_token_layer(4)
    for variant in ("full", "icecache"):
        big = device_kv_bytes_by_role(SimConfig(GEMMA.name, "this-machine", variant, 8000, dense_layers=()), 4, None)
        assert big["sliding"] == 15 * 512 * per
        small = device_kv_bytes_by_role(SimConfig(GEMMA.name, "this-machine", variant, 300, budget=64, dense_layers=(), new_tokens=2), 4, None)
        assert small["sliding"] == 15 * 301 * per
    full = simulate(SimConfig(GEMMA.name, "this-machine", "full", 8000, new_tokens=2), _costs("this-machine", profile), with_prefill=False)
    assert full.full_kv_bytes == full.device_kv_bytes == (15 * 512 + 3 * 8001) * per


def test_icecache_runs_on_the_global_layers_only(profile):
    costs = _costs("this-machine", profile)
    cfg = SimConfig(GEMMA.name, "this-machine", "icecache", 8000, budget=256, page_size=16, dense_layers=(), threads=2, new_tokens=2)
    assert layer_roles(GEMMA, "icecache", ()).count("sparse") == 3
    assert layer_roles(GEMMA, "icecache", (0, 1)) == layer_roles(GEMMA, "icecache", ())  # layers 0, 1 are sliding anyway
    assert layer_roles(GEMMA, "icecache", tuple(range(6)))[5] == "dense"
    res = simulate(cfg, costs, Fixed(0.5), with_prefill=False)
    mid = 8001 - 4 - 64
    assert res.bytes_per_step == pytest.approx(3 * 1 * (256 / 16) * 0.5 * GEMMA.page_bytes(16, 4))
    assert res.host_kv_bytes == 3 * mid * GEMMA.kv_bytes_per_token_layer(4)
    pre = plan_prefill(cfg, costs)
    assert [layer for layer, pl in enumerate(pre.layers) if pl.build_jobs] == [5, 11, 17]
    assert all(pl.offload_s == 0 for layer, pl in enumerate(pre.layers) if layer not in (5, 11, 17))
    # the all-global model offloads and indexes all 18 layers: more select work, same per-layer cost
    allg = simulate(cfg.replace(model=ALL_GLOBAL.name), costs, Fixed(0.5), with_prefill=False)
    assert allg.stages["select"] == pytest.approx(res.stages["select"] * 18 / 3, rel=1e-9)


def test_gpu_prefill_of_a_sliding_layer_skips_the_masked_scores(profile):
    costs = _costs("h100", profile)
    n = 32_000
    assert costs.prefill_layer_s(GEMMA, n, window=512) < costs.prefill_layer_s(GEMMA, n)
    assert costs.prefill_layer_s(GEMMA, 400, window=512) == pytest.approx(costs.prefill_layer_s(GEMMA, 400), rel=1e-3)
    # query i attends min(i, w) keys
    assert GEMMA.prefill_attention_flops(10, 4) == 4.0 * (1 + 2 + 3 + 4 * 7) * GEMMA.q_heads * GEMMA.head_dim
    # the CPU runs transformers' SDPA with the window as a mask: no saving measured, none modelled
    here = _costs("this-machine", profile)
    assert here.prefill_layer_s(GEMMA, 2000, window=512) == here.prefill_layer_s(GEMMA, 2000)


@pytest.mark.model
def test_gemma_shape_matches_the_loaded_model():
    """The fast variant of the GGUF parameter count (make test-slow): the simulator's Gemma-3-270M shape
    against the model `icecache.load_model` builds (tied embeddings counted once), and its attention layout."""
    import icecache

    model, _ = icecache.load_model("gemma-3-270m")
    text = model.config.get_text_config()
    assert GEMMA.total_params() == sum(p.numel() for p in model.parameters())
    assert (GEMMA.layers, GEMMA.kv_heads, GEMMA.head_dim) == (text.num_hidden_layers, text.num_key_value_heads, text.head_dim)
    assert GEMMA.sliding_window == text.sliding_window
    assert [i for i, t in enumerate(text.layer_types) if t == "full_attention"] == [5, 11, 17]
