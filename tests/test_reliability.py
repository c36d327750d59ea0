"""Reliability and security: faults, untrusted files, determinism, fuzzed input, a short soak."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import threading
import weakref

import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.core.errors import (
    ConfigError,
    IceCacheError,
    InputError,
    InputTypeError,
    ModelLoadError,
    UnknownNameError,
)
from icecache.runtime import models
from icecache.runtime.attention import use_attention

PAGERS = icecache.available_pagers()
FUZZ_COUNTER = {"pager_ops": 0, "configs": 0, "cli": 0}
#: ICECACHE_FUZZ_SCALE=20 multiplies every fuzz test's example count (the reliability campaign uses it).
FUZZ_SCALE = int(os.environ.get("ICECACHE_FUZZ_SCALE", "1"))


def _ids(n=120, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, cache, ids, steps):
    with use_attention(model), torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=steps,
                              do_sample=False, pad_token_id=0)


# ------------------------------------------------------------------------------------------ faults
def test_bulk_loader_failure_surfaces_and_next_generation_works(tiny_llama):
    cfg = IceCacheConfig(index="sequential", budget=16, sink=4, window=16, dense_layers=())
    cache = IceCache(tiny_llama.config, cfg)

    def fail(layer, length):
        if length > 125:
            raise RuntimeError("injected bulk-loader failure")

    cache.inject_fault("load", fail)
    with pytest.raises(RuntimeError, match="injected bulk-loader failure"):
        _generate(tiny_llama, cache, _ids(), 20)
    cache.close()
    with IceCache(tiny_llama.config, cfg) as c2:
        out = _generate(tiny_llama, c2, _ids(), 5)
    assert out.shape[1] == 125


def test_keyboard_interrupt_mid_generation_releases_everything(tiny_llama):
    baseline_threads = threading.active_count()
    cfg = IceCacheConfig(index="sequential", budget=16, sink=4, window=16, dense_layers=(), threads=2)
    cache = IceCache(tiny_llama.config, cfg)

    def interrupt(layer, length):
        if length == 130 and layer == 2:
            raise KeyboardInterrupt

    cache.inject_fault("decode", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _generate(tiny_llama, cache, _ids(), 30)
    buf = weakref.ref(cache.layers[1].keys)
    store_pool = weakref.ref(cache.layers[1].stores[0][0].pool)
    cache.close()
    gc.collect()
    assert buf() is None and store_pool() is None, "device buffers or host pages survived close()"
    assert cache.device_kv_bytes() == 0 and cache.host_kv_bytes() == 0
    assert threading.active_count() <= baseline_threads, "worker threads survived close()"
    with IceCache(tiny_llama.config, cfg) as c2:  # a new generation afterwards works
        assert _generate(tiny_llama, c2, _ids(), 4).shape[1] == 124


# ------------------------------------------------------------------------------------------ untrusted files
def test_truncated_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path / "cache"))
    src = models.locate_gguf(models.MODELS["smollm2-135m-instruct"])
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # the first MiB only
    with pytest.raises(ModelLoadError, match="could not read the GGUF file"):
        icecache.load_model(bad)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()], "half-written cache files"


def test_pickle_only_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    with pytest.raises(ModelLoadError, match="never unpickles"):
        icecache.load_model(tmp_path)


def test_remote_code_is_not_executed(tmp_path, tiny_llama):
    """A model directory asking for its own Python code is refused unless trust_remote_code=True."""
    tiny_llama.save_pretrained(tmp_path, safe_serialization=True)
    marker = tmp_path / "PWNED"
    (tmp_path / "evil_model.py").write_text(f"open({str(marker)!r}, 'w').write('code ran')\n")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil_model.EvilModel", "AutoConfig": "evil_model.EvilConfig"}
    cfg["model_type"] = "evil"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError):
        icecache.load_model(tmp_path)
    assert not marker.exists(), "the model's own code was executed"


@pytest.mark.model
def test_corrupt_cached_copy_is_rebuilt(tmp_path, monkeypatch, smollm2):
    """A damaged converted copy is detected, rebuilt from the GGUF file, and loads."""
    src_entries = list((models.cache_root() / "models").glob("*/icecache.json"))  # made by the smollm2 fixture
    assert src_entries
    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path / "cache"))
    dst = tmp_path / "cache" / "models" / src_entries[0].parent.name
    shutil.copytree(src_entries[0].parent, dst)  # start from a good copy (saves a conversion) ...
    weights = next(dst.glob("*.safetensors"))
    good_size = weights.stat().st_size
    with open(weights, "r+b") as f:  # ... then damage it as a crash mid-copy or a full disk would
        f.truncate(good_size // 3)
    with pytest.warns(UserWarning, match="rebuilding it"):
        model, _tok = icecache.load_model()
    assert model.config.num_hidden_layers == 30
    assert not list((tmp_path / "cache" / "models").glob(".*tmp*")), "temporary conversion left behind"
    meta = json.loads((dst / "icecache.json").read_text())
    assert meta["sha256"] and next(dst.glob("*.safetensors")).stat().st_size == good_size  # rebuilt whole


# ------------------------------------------------------------------------------------------ determinism
@pytest.mark.parametrize("name", PAGERS)
def test_same_seed_same_selections_and_text_for_any_thread_count(name):
    runs = []
    for threads in (1, 2, 1):
        model = make_tiny_llama(seed=0)
        cfg = IceCacheConfig(index=name, budget=24, page_size=4, sink=4, window=16, dense_layers=(), threads=threads,
                             trace=True, seed=7)
        with IceCache(model.config, cfg) as cache:
            out = _generate(model, cache, _ids(200), 24)
            runs.append((out[0].tolist(), [(r["layer"], r["kv_head"], r["pages"]) for r in cache.trace]))
    assert runs[0] == runs[1] == runs[2]


# ------------------------------------------------------------------------------------------ fuzzing
def _adversarial(draw_kind: str, n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g)
    if draw_kind == "dup":
        return base[:1].repeat(n, 1)
    if draw_kind == "zeros":
        return torch.zeros(n, d)
    if draw_kind == "huge":
        return base * 1e14
    if draw_kind == "tiny":
        return base * 1e-30
    if draw_kind == "mixed":
        scale = torch.logspace(-20, 12, n)[:, None]
        return base * scale
    if draw_kind == "nan" and n:
        base[n // 2, 0] = float("nan")
        return base
    if draw_kind == "inf" and n:
        base[0, d - 1] = float("-inf")
        return base
    if draw_kind == "too_big":
        return base * 1e20
    return base


KINDS = ["normal", "dup", "zeros", "huge", "tiny", "mixed", "nan", "inf", "too_big"]
op = st.tuples(st.sampled_from(["build", "insert", "select", "bad_dim", "bad_dtype"]), st.sampled_from(KINDS),
               st.integers(0, 40), st.integers(0, 2**30))


@pytest.mark.parametrize("name", PAGERS)
@settings(max_examples=30 * FUZZ_SCALE)
@given(ops=st.lists(op, min_size=1, max_size=8), P=st.integers(1, 8))
def test_fuzz_pager_api(name, ops, P):
    """Every operation either works (invariants hold) or raises one of our documented exceptions."""
    d = 8
    pager = icecache.make_pager(name, head_dim=d, page_size=P, seed=1)
    n = 0
    for kind, keys_kind, m, seed in ops:
        FUZZ_COUNTER["pager_ops"] += 1
        rows = max(1, m % 5) if kind == "select" else m
        invalid = kind in ("bad_dim", "bad_dtype") or (keys_kind in ("nan", "inf", "too_big") and rows > 0)
        try:
            if kind == "build":
                pager.build(_adversarial(keys_kind, m, d, seed))
                n = m
            elif kind == "insert":
                pager.insert(_adversarial(keys_kind, m, d, seed))
                n += m
            elif kind == "select":
                q = _adversarial(keys_kind, rows, d, seed)
                sel = pager.select(q, m)
                assert sel.num_tokens <= m
                # Documented score contract: never NaN or +inf; -inf only marks pages the search did not
                # score (included because the budget exceeds what it scored), and those come last.
                sc = sel.scores
                assert not torch.isnan(sc).any() and not (sc == float("inf")).any()
                fin = torch.isfinite(sc)
                assert not (fin[1:] & ~fin[:-1]).any()
                assert len(set(sel.positions.tolist())) == sel.num_tokens
            elif kind == "bad_dim":
                pager.insert(torch.randn(max(m, 1), d + 1))
            else:
                pager.insert(torch.randint(0, 5, (max(m, 1), d)))
        except (InputError, InputTypeError) as exc:
            assert invalid, f"{kind}/{keys_kind} raised {exc!r} on valid input"
            continue
        assert not invalid, f"{kind}/{keys_kind}: bad input accepted"
        assert len(pager) == n
        pager.table.check()


@settings(max_examples=200 * FUZZ_SCALE)
@given(st.dictionaries(
    st.sampled_from(["budget", "page_size", "sink", "window", "reuse_every", "threads", "seed", "index", "dense_layers", "trace"]),
    st.one_of(st.integers(-5, 5000), st.floats(allow_nan=True), st.text(max_size=8), st.booleans(), st.none(),
              st.lists(st.integers(-3, 40), max_size=4).map(tuple)),
))
def test_fuzz_config(kwargs):
    FUZZ_COUNTER["configs"] += 1
    try:
        cfg = IceCacheConfig(**kwargs)
    except ConfigError:
        return
    assert cfg.budget >= 0 and cfg.page_size >= 1 and cfg.window >= 1 and isinstance(cfg.index, str) and cfg.index
    if cfg.index not in icecache.available_pagers():  # the registry refuses it where pagers are made
        with pytest.raises(UnknownNameError, match="pager"):
            icecache.make_pager(cfg.index, head_dim=8)


@settings(max_examples=200 * FUZZ_SCALE)
@given(st.lists(st.sampled_from(["--budget", "--page-size", "--window", "--sink", "--index", "--dense-layers",
                                 "--reuse-every", "--threads", "-5", "0", "64", "abc", "mdci", "1,2", "", "--full"]), max_size=8))
def test_fuzz_cli_arguments(argv):
    """`icecache generate` argument handling: argparse's exit 2, one of our one-line errors (nothing else: a
    bare ValueError or TypeError fails the test), or a config in which every given flag took effect."""
    from icecache.cli import ICE_OPTIONS, _ice_config, build_parser

    FUZZ_COUNTER["cli"] += 1
    parser = build_parser()
    try:
        args = parser.parse_args(["generate", "hello", *argv])
    except SystemExit as exc:
        assert exc.code == 2
        return
    try:
        cfg = _ice_config(args)
    except IceCacheError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    for name in ICE_OPTIONS:
        given = getattr(args, name)
        if given is not None and name not in ("dense_layers", "index_params"):
            assert getattr(cfg, name) == given, (name, given, getattr(cfg, name))
    if args.dense_layers is not None:
        assert cfg.dense_layers == tuple(sorted({int(x) for x in args.dense_layers.split(",") if x.strip()}))


def test_report_fuzz_counts(capsys):
    """Runs last in this module: prints how many fuzz cases ran (collected by experiments/reliability)."""
    print(f"FUZZ_CASES {json.dumps(FUZZ_COUNTER)}")


# ------------------------------------------------------------------------------------------ soak (short)
def test_soak_short_tiny_model():
    """A shortened soak: invariants at checkpoints while decoding well past the window (see experiments/soak.py)."""
    from icecache.eval.soak import soak

    model = make_tiny_llama(seed=0)
    for name in PAGERS:
        report = soak(model, IceCacheConfig(index=name, budget=24, page_size=4, sink=4, window=16, dense_layers=(0,)),
                      prompt_tokens=150, new_tokens=250, checkpoint_every=100, verify_host=True)
        assert report["device_bytes_constant"] and report["host_growth_exact"] and report["conservation_checks"] >= 2
        assert report["host_checks"] == report["conservation_checks"]  # host K equals a full cache's, every pager
        # what the index and the host blocks add per decode step stays within a few times the K/V it holds
        kv_per_step = report["host_bytes_per_step"]
        assert 0 < report["index_bytes_per_step"] <= 4 * kv_per_step, (name, report["index_bytes_per_step"], kv_per_step)
        # host blocks are reserved by capacity doubling, so a window of a few hundred steps may reserve none
        # (`HeadStore.load_layout` leaves a quarter spare, `icecache.core.capacity`); never more than a few K/V
        assert 0 <= report["host_allocated_bytes_per_step"] <= 4 * kv_per_step, (name, report["host_allocated_bytes_per_step"])
        assert 0 < report["select_end_ms"] < report["tpot_end_ms"] and math.isfinite(report["tpot_drift_without_select"])
    # inserts on the decode thread: the same invariants, the run says how it inserted
    report = soak(model, IceCacheConfig(index="mdci", budget=24, page_size=4, sink=4, window=16, dense_layers=()),
                  prompt_tokens=150, new_tokens=120, checkpoint_every=60, background_inserts=False)
    assert report["device_bytes_constant"] and report["host_growth_exact"] and report["conservation_checks"] == 2
    assert report["background_inserts"] is False and (report["budget"], report["page_size"]) == (24, 4)


def test_soak_reference_cache_decodes_in_lockstep():
    """``reference_every``: a warm-size reference cache decodes beside the soak (re-prefilled every R steps, its
    own warm-up steps left out of its medians); the soak's invariants still hold and every cache is closed."""
    from icecache.eval.soak import soak

    model = make_tiny_llama(seed=0)
    cfg = IceCacheConfig(index="mdci", budget=24, page_size=4, sink=4, window=16, dense_layers=())
    r = soak(model, cfg, prompt_tokens=150, new_tokens=200, checkpoint_every=100, reference_every=20)
    assert r["device_bytes_constant"] and r["host_growth_exact"] and r["threads_end"] <= r["threads_start"]
    assert r["reference_every"] == 20 and r["ref_end_ms"] > 0 and r["ref_end_without_index_ms"] > 0
    # its index stays at warm-up size: prompt - sink - window + (2 .. 20) steps since its prefill
    assert 150 - 20 + 2 <= r["ref_warm_n"] <= r["ref_end_n"] <= 150 - 20 + 20
    with pytest.raises(ConfigError, match="reference_every"):
        soak(model, cfg, prompt_tokens=150, new_tokens=10, reference_every=-1)
    with pytest.raises(ConfigError, match="reference_every"):
        soak(model, cfg, prompt_tokens=150, new_tokens=10, reference_every=True)


def test_heap_trim_bounds_rss_growth_fast():
    """The fast variant of the 20k soak's RSS bound (make test-slow has the long one): hnsw over 2,400 steps.
    Growth must stay within a few times what the cache really adds per step (host K/V plus the index), which
    catches a per-step leak of a few KB. glibc's heap growth, which `heap_policy="trim"` bounds, shows only in
    long runs (README: Slow suite), so this test does not cover it."""
    from icecache.eval.soak import soak

    model = make_tiny_llama(seed=0, max_position_embeddings=1 << 14)
    r = soak(model, IceCacheConfig(index="hnsw", budget=32, page_size=8, sink=4, window=16, dense_layers=(0,)),
             prompt_tokens=256, new_tokens=2_400, checkpoint_every=400)
    assert r["device_bytes_constant"] and r["host_growth_exact"] and r["conservation_checks"] == 6
    assert r["rss_slope_bytes_per_step"] < 4 * (r["host_bytes_per_step"] + r["index_bytes_per_step"]) + 4096, r["rss_slope_bytes_per_step"]


@pytest.mark.model
def test_soak_short_embedded_model(smollm2):
    """The fast variant of the SmolLM2 20k soak (make test-slow): 160 steps past a 600-token real-text prompt with
    M-DCI, window 32, so tokens leave the window for the host pages every step."""
    from icecache.eval.soak import soak
    from icecache.eval.tasks import text_window

    model, tok = smollm2
    ids = torch.tensor([text_window(tok, 600, seed=7)])
    r = soak(model, IceCacheConfig(index="mdci", budget=64, window=32), prompt_tokens=600, new_tokens=160, input_ids=ids,
             checkpoint_every=80, verify_host=True)
    assert r["device_bytes_constant"] and r["host_growth_exact"] and r["conservation_checks"] == 2 and r["host_checks"] == 2
    assert r["threads_end"] <= r["threads_start"]


# ------------------------------------------------------------------------------------------ soak (full, slow)
@pytest.mark.slow
@pytest.mark.parametrize("name", PAGERS)
def test_soak_20k_tokens_tiny_model(name):
    """The issue's soak: 20k tokens past a 1k prompt with every pager; host K checked against a full cache."""
    from icecache.eval.soak import soak

    model = make_tiny_llama(seed=0, max_position_embeddings=1 << 16)
    r = soak(model, IceCacheConfig(index=name, budget=64, page_size=8, sink=4, window=32, dense_layers=(0,)),
             prompt_tokens=1024, new_tokens=20_000, checkpoint_every=2_000, verify_host=True)
    assert r["device_bytes_constant"] and r["host_growth_exact"]
    assert r["conservation_checks"] == 10 and r["host_checks"] == 10
    assert r["threads_end"] <= r["threads_start"]
    # what the cache adds per step (host KV + the pagers' index), not a leak: hnsw grew 376 KB per step here
    # before the runtime's heap_policy (icecache.runtime.malloc); 9.9 KB per step with the default "trim"
    assert r["rss_slope_bytes_per_step"] < 4 * (r["host_bytes_per_step"] + r["index_bytes_per_step"]) + 4096


@pytest.mark.slow
def test_soak_20k_tokens_embedded_model(smollm2):
    """20k tokens past a 4k real-text prompt on SmolLM2 with M-DCI (~30 min on 2 cores)."""
    from icecache.eval.soak import soak
    from icecache.eval.tasks import text_window

    model, tok = smollm2
    ids = torch.tensor([text_window(tok, 4000, seed=7)])
    r = soak(model, IceCacheConfig(index="mdci", budget=256), prompt_tokens=4000, new_tokens=20_000, input_ids=ids,
             checkpoint_every=2_000)
    assert r["device_bytes_constant"] and r["host_growth_exact"] and r["conservation_checks"] == 10
    assert r["threads_end"] <= r["threads_start"]
