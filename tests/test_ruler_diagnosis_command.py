"""``eval ruler --diagnose``: target parsing, resumable classification rows, the counts table, one-line errors."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import make_tiny_llama
from test_ruler_runner import CharTokenizer

from icecache import IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.eval.ruler.diagnose import diagnose_losses, diagnose_targets, row_key, scan_config
from icecache.eval.ruler.diagnosis_command import diagnosis_markdown, parse_targets, reference_records, run_diagnose


class OffsetCharTokenizer(CharTokenizer):
    """`CharTokenizer` that also reports each token's character span (BOS spans nothing)."""

    def __call__(self, text, add_special_tokens=True, return_tensors=None, return_offsets_mapping=False):
        out = super().__call__(text, add_special_tokens=add_special_tokens, return_tensors=return_tensors)
        if return_offsets_mapping:
            out["offset_mapping"] = ([(0, 0)] if add_special_tokens else []) + [(i, i + 1) for i in range(len(text))]
        return out


def _record(index: int, method: str, budget: str, score: float) -> dict:
    return {"task": "niah_single_1", "length": 3000, "index": index, "method": method, "budget": budget, "score": score}


def test_targets_parse_and_refuse_bad_input():
    assert parse_targets("icecache@256, quest@64") == [("icecache", "256"), ("quest", "64")]
    assert parse_targets("icecache[page_size=4,field_of_view=200]@256,quest[page_size=4]@64") == [
        ("icecache[page_size=4,field_of_view=200]", "256"), ("quest[page_size=4]", "64")]
    for bad, match in (("icecache", "METHOD@BUDGET"), ("icecache@x", "METHOD@BUDGET"), ("full@64", "reference"),
                       ("nosuch@64", "nosuch"), ("", "METHOD@BUDGET"), ("@64", "METHOD@BUDGET")):
        with pytest.raises(ConfigError, match=match):
            parse_targets(bad)


def test_losses_are_classified_once_and_a_rerun_skips_them():
    model = make_tiny_llama(seed=5, max_position_embeddings=8192)
    tok = OffsetCharTokenizer()
    records = [
        _record(0, "full", "-", 1.0), _record(0, "exact", "32", 1.0), _record(0, "icecache", "32", 0.0),  # replayed
        _record(1, "full", "-", 0.0), _record(1, "exact", "32", 1.0), _record(1, "icecache", "32", 0.0),  # model
        _record(2, "full", "-", 1.0), _record(2, "exact", "32", 0.0), _record(2, "icecache", "32", 0.0),  # budget
        _record(3, "full", "-", 1.0), _record(3, "exact", "32", 1.0), _record(3, "icecache", "32", 1.0),  # not lost
        _record(4, "icecache", "32", 0.0),  # lost, but full and exact have not run it yet: not classified
    ]
    config = IceCacheConfig(budget=32, page_size=8, sink=4, window=32, dense_layers=(0,), threads=1)
    seen = []
    rows = diagnose_losses(model, tok, records, "icecache", "32", seed=42, config=config, chat_template=False,
                           progress=False, on_row=seen.append)
    assert rows == seen
    classes = {r["index"]: r["class"] for r in rows}
    assert classes[1] == "model" and classes[2] == "budget" and classes[0] in ("page miss", "search miss")
    assert set(classes) == {0, 1, 2}
    replayed = next(r for r in rows if r["index"] == 0)
    assert replayed["steps"] >= 1
    assert all(0.0 <= replayed[k] <= 1.0 for k in ("search_recall", "pages_recall", "oracle_recall"))
    recomputed = []
    again = diagnose_losses(model, tok, records, "icecache", "32", seed=42, config=config, chat_template=False,
                            progress=False, previous={row_key(r): r for r in rows}, on_row=recomputed.append)
    assert recomputed == [] and sorted(again, key=lambda r: r["index"]) == sorted(rows, key=lambda r: r["index"])
    table = diagnosis_markdown(records, rows, [("icecache", "32")])
    line = next(x for x in table.splitlines() if "icecache@32" in x)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["3000", "icecache@32", "5", "4", "3"]  # samples, lost, classified
    assert cells[5:9] == ["1", "1", str(int(classes[0] == "page miss")), str(int(classes[0] == "search miss"))]
    assert cells[10] == "2 (1)"  # samples 0 and 2 scored below full; on sample 2 the oracle did too


def test_an_mdci_loss_is_answered_again_with_the_pages_ranked_exhaustively(monkeypatch):
    """An M-DCI method's loss that full attention and the oracle answer is answered again with
    ``search="exhaustive"``; the class follows that answer, whatever the recalls say. Other pagers keep the
    recalls' verdict (nothing to re-answer with)."""
    import icecache.eval.ruler.diagnose as diagnose

    monkeypatch.setattr(diagnose, "replay", lambda *a, **k: diagnose.Replay(0.2, 0.9, 1.0, 3))
    configs = []
    real_scan_config = diagnose.scan_config
    monkeypatch.setattr(diagnose, "scan_config", lambda m, c: configs.append(real_scan_config(m, c)) or configs[-1])
    model = make_tiny_llama(seed=5, max_position_embeddings=8192)
    records = [_record(0, "full", "-", 1.0), _record(0, "exact", "32", 1.0), _record(0, "icecache", "32", 0.0)]
    config = IceCacheConfig(budget=32, page_size=8, sink=4, window=32, dense_layers=(0,), threads=1)
    [row] = diagnose_losses(model, OffsetCharTokenizer(), records, "icecache", "32", seed=42, config=config,
                            chat_template=False, progress=False)
    assert configs[-1].index == "mdci" and configs[-1].index_params == {"search": "exhaustive"}
    assert 0.0 <= row["scan_score"] <= 1.0
    assert row["class"] == ("search miss" if row["scan_score"] >= 1.0 else "page miss")
    [other] = diagnose_losses(model, OffsetCharTokenizer(), records, "icecache", "32", seed=42,
                              config=config.replace(index="sequential"), chat_template=False, progress=False)
    assert configs[-1] is None and "scan_score" not in other and other["class"] == "search miss"


def _args(out, **kw) -> argparse.Namespace:
    base = dict(out=None if out is None else str(out), diagnose="icecache@256", model=None, json=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_command_refuses_a_directory_without_a_run(tmp_path):
    with pytest.raises(ConfigError, match="run.json not found"):
        run_diagnose(_args(tmp_path))
    with pytest.raises(ConfigError, match="needs --out"):
        run_diagnose(_args(None))
    (tmp_path / "run.json").write_text(json.dumps({"model": "smollm2-135m-instruct", "seed": 42, "config": {}, "chat_template": None}))
    with pytest.raises(ConfigError, match="used smollm2-135m-instruct, not gemma-3-270m"):
        run_diagnose(_args(tmp_path, model="gemma-3-270m"))
    with pytest.raises(ConfigError, match="no predictions"):
        run_diagnose(_args(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # nothing half-written


def test_a_variant_of_icecache_is_answered_again_with_its_own_settings_and_the_exhaustive_ranking():
    config = IceCacheConfig(budget=32, page_size=16, index="mdci", index_params={})
    scan = scan_config("icecache[page_size=4;field_of_view=200]", config)
    assert scan is not None and scan.index_params == {"search": "exhaustive"}
    from icecache.eval.methods import get_method

    ranked = get_method("icecache[page_size=4;field_of_view=200]").configure(scan)
    assert ranked.page_size == 4 and ranked.index_params == {"search": "exhaustive", "field_of_view": 200}
    assert scan_config("quest[page_size=4]", config) is None
    assert scan_config("icecache[page_size=4]", config.replace(index="ivf")) is None


def _write_run(path, config: dict, rows: list[dict], **run) -> None:
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"model": "gemma-3-270m", "seed": 42, "config": config,
                                               "chat_template": None, **run}))
    (path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_references_supply_full_and_exact_rows_of_a_run_of_the_same_samples(tmp_path):
    config = {"page_size": 16, "sink": 4, "window": 64, "index": "mdci", "index_params": {}}
    variant = [_record(0, "icecache[page_size=4]", "256", 0.0)]
    refs = [_record(0, "full", "-", 1.0), _record(0, "exact", "256", 1.0), _record(0, "quest", "256", 0.0)]
    run = {"model": "gemma-3-270m", "seed": 42, "config": {**config, "page_size": 4, "index_params": {"field_of_view": 200}},
           "chat_template": None}
    _write_run(tmp_path / "same", config, refs)
    assert [r["method"] for r in reference_records(run, variant, tmp_path / "same")] == ["full", "exact"]
    _write_run(tmp_path / "window", {**config, "window": 32}, refs)
    _write_run(tmp_path / "seed", config, refs, seed=7)
    _write_run(tmp_path / "nofull", config, refs[2:])
    for name, match in (("window", "window differ"), ("seed", "ran seed 7"), ("nofull", "no full or exact rows"),
                        ("missing", "run.json not found")):
        with pytest.raises(ConfigError, match=match):
            reference_records(run, variant, tmp_path / name)
    with pytest.raises(ConfigError, match="holds its own full rows"):
        reference_records(run, variant + refs[:1], tmp_path / "same")


def test_below_full_counts_partial_credit():
    records = [_record(0, "full", "-", 0.5), _record(0, "exact", "64", 0.75), _record(0, "quest", "64", 0.25),
               _record(1, "full", "-", 0.5), _record(1, "exact", "64", 0.25), _record(1, "quest", "64", 0.0),
               _record(2, "full", "-", 0.5), _record(2, "quest", "64", 0.5),  # equal: not below
               _record(3, "quest", "64", 0.0)]  # full has not run it: left out
    line = next(x for x in diagnosis_markdown(records, [], [("quest", "64")]).splitlines() if "quest@64" in x)
    assert line.rstrip("| ").endswith("2 (1)")


def test_stored_rows_are_reclassified_and_only_a_missing_replay_is_run_again(monkeypatch):
    """Rows of an earlier rule are re-classified from their scores; a partial-credit loss that full attention
    and the oracle both beat, stored as ``model`` without a replay, is replayed now."""
    import icecache.eval.ruler.diagnose as diagnose

    replays = []
    monkeypatch.setattr(diagnose, "replay", lambda *a, **k: replays.append(1) or diagnose.Replay(0.2, 0.9, 1.0, 3))
    model = make_tiny_llama(seed=5, max_position_embeddings=8192)
    records = [_record(0, "full", "-", 0.5), _record(0, "exact", "32", 0.5), _record(0, "icecache", "32", 0.0),
               _record(1, "full", "-", 0.5), _record(1, "exact", "32", 0.25), _record(1, "icecache", "32", 0.25)]
    stored = [{**_record(0, "icecache", "32", 0.0), "full": 0.5, "oracle": 0.5, "class": "model"},
              {**_record(1, "icecache", "32", 0.25), "full": 0.5, "oracle": 0.25, "class": "model"}]
    config = IceCacheConfig(budget=32, page_size=8, sink=4, window=32, dense_layers=(0,), threads=1, index="sequential")
    recomputed = []
    rows = diagnose_losses(model, OffsetCharTokenizer(), records, "icecache", "32", seed=42, config=config,
                           chat_template=False, progress=False, previous={row_key(r): r for r in stored},
                           on_row=recomputed.append)
    classes = {r["index"]: r["class"] for r in rows}
    assert classes == {0: "search miss", 1: "budget"} and len(replays) == 1
    assert [r["index"] for r in recomputed] == [0] and recomputed[0]["search_recall"] == 0.2


def test_the_command_rewrites_one_row_per_sample(tmp_path, monkeypatch):
    import icecache.eval.ruler.diagnose as diagnose
    import icecache.runtime.models as models

    monkeypatch.setattr(diagnose, "replay", lambda *a, **k: diagnose.Replay(0.2, 0.9, 1.0, 3))
    monkeypatch.setattr(models, "load_model", lambda name: (make_tiny_llama(seed=5, max_position_embeddings=8192),
                                                            OffsetCharTokenizer()))
    config = {"budget": 32, "page_size": 8, "sink": 4, "window": 32, "dense_layers": [0], "threads": 1, "index": "sequential"}
    records = [_record(0, "full", "-", 0.5), _record(0, "exact", "32", 0.5), _record(0, "icecache", "32", 0.0),
               _record(1, "full", "-", 0.0), _record(1, "exact", "32", 0.0), _record(1, "icecache", "32", 0.0)]
    _write_run(tmp_path / "run", config, records, chat_template=False)
    old = {**_record(1, "icecache", "32", 0.0), "full": 0.0, "oracle": 0.0, "class": "budget"}
    other = {**_record(1, "quest", "32", 0.0), "full": 0.0, "oracle": 0.0, "class": "model"}  # not diagnosed now: kept
    (tmp_path / "run" / "diagnosis.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (old, old, other)))
    assert run_diagnose(_args(tmp_path / "run", diagnose="icecache@32")) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "diagnosis.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["index"], r["class"]) for r in rows) == [
        ("icecache", 0, "search miss"), ("icecache", 1, "model"), ("quest", 1, "model")]
    assert "| 3000 | icecache@32 | 2 | 2 | 2 | 1 | 0 | 0 | 1 |" in (tmp_path / "run" / "diagnosis.md").read_text()
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_targets_that_lost_the_same_sample_share_one_prefill_and_match_one_target_at_a_time(monkeypatch):
    """Two targets replaying the same two samples prefill each sample once (not once per target), and give
    the rows each target gets alone."""
    import icecache.eval.harness as harness

    prefills = []
    real_prefill = harness.run_prefill
    monkeypatch.setattr(harness, "run_prefill", lambda *a, **k: prefills.append(1) or real_prefill(*a, **k))
    model = make_tiny_llama(seed=5, max_position_embeddings=8192)
    records = [r for i in (0, 1) for r in (_record(i, "full", "-", 1.0), _record(i, "exact", "32", 1.0),
                                             _record(i, "icecache", "32", 0.0), _record(i, "quest", "32", 0.0))]
    config = IceCacheConfig(budget=32, page_size=8, sink=4, window=32, dense_layers=(0,), threads=1)
    targets = [("icecache", "32"), ("quest", "32")]
    together = diagnose_targets(model, OffsetCharTokenizer(), records, targets, seed=42, config=config,
                                chat_template=False, progress=False)
    assert len(prefills) == 2  # one per sample, although four replays ran
    for method, budget in targets:
        prefills.clear()
        alone = diagnose_losses(model, OffsetCharTokenizer(), records, method, budget, seed=42, config=config,
                                chat_template=False, progress=False)
        assert len(prefills) == 2
        key = lambda r: r["index"]
        assert sorted(alone, key=key) == sorted(together[(method, budget)], key=key)
        assert all(r["class"] in ("page miss", "search miss") for r in alone)


def test_the_command_replays_with_the_runs_config_and_only_threads_from_the_command_line(tmp_path, monkeypatch):
    import icecache.eval.ruler.diagnose as diagnose
    import icecache.runtime.models as models

    seen = []
    monkeypatch.setattr(diagnose, "diagnose_targets", lambda *a, config, **k: seen.append(config) or {})
    monkeypatch.setattr(models, "load_model", lambda name: (None, OffsetCharTokenizer()))
    config = {"budget": 32, "page_size": 8, "sink": 4, "window": 32, "dense_layers": [0], "index": "sequential"}
    _write_run(tmp_path / "run", config, [_record(0, "icecache", "32", 0.0)], chat_template=False)
    assert run_diagnose(_args(tmp_path / "run", diagnose="icecache@32", threads=1)) == 0
    assert run_diagnose(_args(tmp_path / "run", diagnose="icecache@32")) == 0
    assert [(c.page_size, c.window, c.threads) for c in seen] == [(8, 32, 1), (8, 32, IceCacheConfig().threads)]
