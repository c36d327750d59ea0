"""``index="auto"``: the crossover found from measured times, the choice per cache, its report, the stored
per-machine measurement, and outputs identical to the pager it chose."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given
from hypothesis import strategies as st

from icecache import IceCache, IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.indexes.auto import MAX_CROSSOVER, check_auto_params, choose_index, crossover_from_times, measure_crossover
from icecache.runtime.attention import use_attention

GRID = (2048, 4096, 8192, 16384, 32768, 65536)


@given(slope_ns=st.floats(1.0, 100.0), mdci_us=st.floats(1.0, 5000.0))
def test_crossover_of_a_linear_scorer_and_a_flat_index_is_where_they_meet(slope_ns, mdci_us):
    """the scan costs ``a * n``, the tree search a constant ``c``: they meet at ``n = c / a``, inside the grid, before it or
    beyond it (log ratio linear in log n, so interpolation and extrapolation are both exact)."""
    exact = [slope_ns * 1e-9 * n for n in GRID]
    mdci = [mdci_us * 1e-6] * len(GRID)
    truth = mdci_us * 1e-6 / (slope_ns * 1e-9)
    got = crossover_from_times(GRID, exact, mdci)
    assert got == pytest.approx(min(truth, MAX_CROSSOVER), rel=1e-6, abs=1)
    # the choice follows: every key scored below, the tree search from the crossover on
    below = "mdci[search=exhaustive]" if got > 0 else "mdci"
    assert choose_index(max(got - 1, 0), got) == below and choose_index(got, got) == "mdci"


def test_crossover_when_mdci_never_catches_up_is_capped():
    # both linear, mdci always twice as slow: no crossing, the exact scorer wins everywhere
    assert crossover_from_times(GRID, [1e-9 * n for n in GRID], [2e-9 * n for n in GRID]) == MAX_CROSSOVER
    # mdci always faster and no slower at the smallest size: it is chosen from the first key
    assert crossover_from_times(GRID, [2e-9 * n for n in GRID], [1e-9 * n for n in GRID]) == 0
    with pytest.raises(ValueError):
        crossover_from_times(GRID[:1], [1.0], [1.0])


def test_auto_params_are_checked():
    assert check_auto_params({}) is None and check_auto_params({"crossover": 0}) == 0
    for bad in ({"crossover": -1}, {"crossover": True}, {"crossover": 1.5}):
        with pytest.raises(ConfigError, match="crossover must be an int"):
            check_auto_params(bad)
    with pytest.raises(ConfigError, match="no parameter 'nprobe'"):
        check_auto_params({"nprobe": 4})
    model = make_tiny_llama()
    with pytest.raises(ConfigError, match="no parameter 'nprobe'"):
        IceCache(model.config, IceCacheConfig(index="auto", index_params={"nprobe": 4}))
    with pytest.raises(ConfigError, match="takes no pager_factory"):
        IceCache(model.config, IceCacheConfig(index="auto"), pager_factory=lambda *a: None)


def test_nearly_equal_ratios_extrapolate_to_the_cap_without_overflow():
    """Two outer ratios a hair apart put the extrapolated root at e^(10^13): capped, not an OverflowError (a
    fresh-clone `make test` once hit it through a real 3-call measurement)."""
    grid = (256, 2048)
    assert crossover_from_times(grid, [1.0, 1.0], [2.0, 2.0 * (1 - 1e-12)]) == MAX_CROSSOVER
    assert crossover_from_times(grid, [1.0, 1.0], [0.5, 0.5 * (1 - 1e-12)]) == 0


def test_a_real_measurement_is_consistent():
    r = measure_crossover(16, 4, 32, 8, grid=(256, 2048), calls=3)
    assert len(r["exhaustive_s"]) == len(r["tree_s"]) == 2 and min(r["exhaustive_s"] + r["tree_s"]) > 0
    assert r["crossover_keys"] == crossover_from_times(r["grid"], r["exhaustive_s"], r["tree_s"])
    for part in ("select_s", "insert_s"):  # a step is one select and one insert per pager, both timed
        assert sorted(r[part]) == ["exhaustive", "tree"] and all(len(v) == 2 and min(v) > 0 for v in r[part].values())


def _decode(model, cfg: IceCacheConfig, ids: torch.Tensor, steps: int) -> tuple[list[int], IceCache]:
    cache = IceCache(model.config, cfg)
    out = []
    with use_attention(model), torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        for _ in range(steps):
            tok = logits[0, -1].argmax().view(1, 1)
            out.append(int(tok))
            logits = model(tok, past_key_values=cache, use_cache=True).logits
    cache.pagers_run = _pagers(cache)  # close() lets the pagers go
    cache.close()
    return out, cache


def _pagers(cache: IceCache) -> list[tuple]:
    """What each sparse layer's pagers are: (layer, class, search mode, M-DCI parameters, page size) per KV head."""
    return [(i, type(p).__name__, p.search, p.params, p.page_size)
            for i, layer in enumerate(cache.layers) for row in getattr(layer, "pagers", []) for p in row]


@pytest.mark.parametrize("crossover, chosen, params", [(10_000, "mdci[search=exhaustive]", {"search": "exhaustive"}),
                                                      (0, "mdci", {})])
def test_auto_runs_exactly_the_pager_it_chose(crossover, chosen, params):
    """``index="auto"`` reports its choice and runs it: every sparse layer's pagers are the chosen pager's (class,
    ``search``, parameters), and the tokens are those of a cache configured with that pager. The two choices
    decode the same tokens on this data, so the pagers themselves are compared: running the other choice under
    the reported name fails here."""
    model = make_tiny_llama(seed=3)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(1))
    base = dict(budget=32, page_size=8, sink=4, window=16, dense_layers=(0,))
    got, cache = _decode(model, IceCacheConfig(index="auto", index_params={"crossover": crossover}, **base), ids, 12)
    want, ref = _decode(model, IceCacheConfig(index="mdci", index_params=params, **base), ids, 12)
    stats = cache.stats()
    assert stats["index"] == chosen and stats["auto_crossover_keys"] == crossover
    assert {layer for layer, *_ in cache.pagers_run} == {1, 2, 3} and len(cache.pagers_run) == 3 * 2  # 2 KV heads
    assert {p[1:3] for p in cache.pagers_run} == {("MDCIPager", params.get("search", "tree"))}
    assert cache.pagers_run == ref.pagers_run
    assert got == want


def test_the_machine_crossover_is_measured_once_and_stored(tmp_path, monkeypatch):
    import icecache.runtime.pager_choice as auto_index

    monkeypatch.setenv("ICECACHE_CACHE", str(tmp_path))
    calls = []

    def fake_measure(head_dim, group, budget, page_size, select_threads):
        calls.append((head_dim, group, budget, page_size, select_threads))
        return {"crossover_keys": 300, "grid": [1, 2], "exhaustive_s": [1.0, 2.0], "tree_s": [2.0, 1.0], "calls": 1,
                "seconds": 0.0}

    monkeypatch.setattr(auto_index, "measure_crossover", fake_measure)
    model = make_tiny_llama(seed=3)
    cfg = IceCacheConfig(index="auto", budget=32, page_size=8, sink=4, window=16, dense_layers=(0,))
    short = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))  # 180 middle keys < 300
    long = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(1))  # 380 >= 300
    assert _decode(model, cfg, short, 2)[1].stats()["index"] == "mdci[search=exhaustive]"
    assert _decode(model, cfg, long, 2)[1].stats()["index"] == "mdci"
    # measured once for this shape and the decode's select threads (1 beside background inserts), then read back
    from icecache.runtime.workers import background_inserts

    threads = 1 if background_inserts("auto", torch.device("cpu")) else torch.get_num_threads()
    assert calls == [(16, 4, 32, 8, threads)]
    stored = json.loads((tmp_path / "auto_index.json").read_text())
    assert [e["crossover_keys"] for e in stored.values()] == [300]
    # an unreadable file is measured again and rewritten whole
    (tmp_path / "auto_index.json").write_text("{not json")
    _decode(model, cfg, short, 1)
    assert len(calls) == 2 and json.loads((tmp_path / "auto_index.json").read_text())


def test_max_cache_len_decides_when_given():
    model = make_tiny_llama(seed=3)
    cfg = IceCacheConfig(index="auto", index_params={"crossover": 300}, budget=32, page_size=8, sink=4, window=16,
                         dense_layers=(0,))
    cache = IceCache(model.config, cfg, max_cache_len=1000)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    with use_attention(model), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert cache.stats()["index"] == "mdci"  # 1000 - 20 expected keys, although the prompt has 180
    cache.close()


@pytest.mark.parametrize("config", [
    IceCacheConfig(index="auto", index_params={"crossover": 10_000}, budget=32, page_size=8, sink=4, window=16),
    IceCacheConfig(index="auto", index_params={"crossover": 0}, budget=32, page_size=8, sink=4, window=16),
    IceCacheConfig(index="mdci", index_params={"field_of_view": 7, "page_score": "mass"}, budget=32, page_size=8,
                   sink=4, window=16),
    IceCacheConfig(index="sequential", budget=32, page_size=8, sink=4, window=16),
])
def test_the_reported_index_round_trips(config):
    """Any name ``stats()["index"]`` reports is a valid ``IceCacheConfig.index`` and `make_pager` name, and
    feeding it back makes the same pager (class, parameters) the cache ran."""
    from icecache import make_pager

    model = make_tiny_llama(seed=3)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    cache = IceCache(model.config, config.replace(dense_layers=(0,)))
    with use_attention(model), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    cache.workers.wait_all()
    reported = cache.stats()["index"]
    ran = cache.layers[1].pagers[0][0]
    cache.close()
    again = IceCacheConfig(index=reported, page_size=config.page_size)
    remade = make_pager(reported, head_dim=16, page_size=config.page_size)
    assert type(remade) is type(ran) and again.index == ran.name
    for pager in (remade, make_pager(again.index, head_dim=16, page_size=8, **again.index_params)):
        assert getattr(pager, "search", None) == getattr(ran, "search", None)
        assert getattr(pager, "params", None) == getattr(ran, "params", None)
