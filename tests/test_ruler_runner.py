"""The RULER runner: one prefill per sample for every method, resumable JSONL, RULER-shaped tables."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_tiny_llama

from icecache import IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.eval.ruler.report import bootstrap_average, complete_scores, markdown, summarize
from icecache.eval.ruler.runner import PredictionLog, RulerSpec, pending_units, run_ruler


class CharTokenizer:
    """One token per printable ASCII character (ids 3..98), EOS 2, BOS 1 prepended; fits the tiny Llama's
    vocabulary of 128 and decodes exactly."""

    eos_token_id = 2
    bos_token_id = 1
    pad_token_id = 0
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None):
        ids = [1] if add_special_tokens else []
        ids += [3 + (ord(c) - 32 if 32 <= ord(c) < 127 else 95) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - 3 + 32) if 3 <= i < 98 else ("\n" if i == 98 else "") for i in ids)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(seed=5, max_position_embeddings=8192)


@pytest.fixture
def prefills(monkeypatch) -> list[int]:
    """The prompt length of every `run_prefill` the runner makes (it imports the harness's at each sample)."""
    import icecache.eval.harness as harness

    seen: list[int] = []
    real = harness.run_prefill
    monkeypatch.setattr(harness, "run_prefill", lambda model, ids, **kw: seen.append(int(ids.shape[1])) or real(model, ids, **kw))
    return seen


def _spec(**kw) -> RulerSpec:
    base = dict(model="tiny", tasks=["niah_single_1", "vt"], lengths=[3000], samples=1, methods=["full", "icecache", "quest"],
                budgets=[32], config=IceCacheConfig(budget=32, page_size=8, sink=4, window=32, dense_layers=(0,), threads=1))
    base.update(kw)
    return RulerSpec(**base)


def test_runs_every_method_from_one_prefill_and_resumes(tmp_path, model, prefills):
    """Every method of a sample answers from one dense prefill (counted: `run_prefill` runs once per sample, with
    that sample's prompt), rows finish in order, and a resumed run prefills only the samples it adds."""
    tok = CharTokenizer()
    spec = _spec()
    records = run_ruler(model, tok, spec, tmp_path, progress=False)
    assert len(records) == 2 * 3  # 2 tasks x (full + 2 methods at one budget)
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 6
    prompts = {}
    for r in records:
        prompts.setdefault((r["task"], r["index"]), set()).add(r["prompt_tokens"])
        assert r["budget"] == ("-" if r["method"] == "full" else "32")
        assert 0.0 <= r["score"] <= 1.0 and r["new_tokens"] >= 1
    assert sorted(prefills) == sorted(n for p in prompts.values() for n in p)  # one prefill per sample, not per method
    for task in ("niah_single_1", "vt"):  # rows finish one after another after the shared prefill
        rows = [r for r in records if r["task"] == task]
        ends = [r["done_after_seconds"] for r in rows]
        assert ends == sorted(ends)
        assert all(end >= sum(r["seconds"] for r in rows[: i + 1]) for i, end in enumerate(ends))
    # a re-run finds nothing to do (no prefill); more samples only add (and prefill) the new ones
    assert pending_units(spec, PredictionLog(tmp_path, spec.signature()).done) == []
    prefills.clear()
    assert len(run_ruler(model, tok, spec, tmp_path, progress=False)) == 6 and prefills == []
    more = run_ruler(model, tok, _spec(samples=2), tmp_path, progress=False)
    assert len(more) == 12 and len((tmp_path / "predictions.jsonl").read_text().splitlines()) == 12
    assert len(prefills) == 2  # the second sample of each task


def test_auto_records_the_select_it_chose(tmp_path, model):
    """A run with ``index="auto"`` says in each IceCache record which select auto chose; other runs do not."""
    tok = CharTokenizer()
    cfg = IceCacheConfig(index="auto", index_params={"crossover": 10_000}, budget=32, page_size=8, sink=4, window=32,
                         dense_layers=(0,), threads=1)
    records = run_ruler(model, tok, _spec(tasks=["niah_single_1"], methods=["full", "icecache"], config=cfg), tmp_path,
                        progress=False)
    assert {r["method"]: r.get("auto_choice") for r in records} == {"full": None, "icecache": "mdci[search=exhaustive]"}
    plain = run_ruler(model, tok, _spec(tasks=["niah_single_1"], methods=["icecache"]), tmp_path / "b", progress=False)
    assert all("auto_choice" not in r for r in plain)


def test_a_variant_row_is_the_run_with_those_settings(tmp_path, model, prefills):
    """``icecache[page_size=4;field_of_view=6]`` and ``quest[page_size=4]`` rows, answered beside the plain rows
    from the same prefill, give token for token what a run whose config has those settings gives."""
    tok = CharTokenizer()
    mixed = run_ruler(model, tok, _spec(tasks=["niah_single_1"], methods=["icecache", "icecache[page_size=4;field_of_view=6]",
                                                                       "quest[page_size=4]"]), tmp_path / "a", progress=False)
    assert len(prefills) == 1  # one prefill for the three rows
    cfg = IceCacheConfig(budget=32, page_size=4, sink=4, window=32, dense_layers=(0,), threads=1,
                         index_params={"field_of_view": 6})
    alone = run_ruler(model, tok, _spec(tasks=["niah_single_1"], methods=["icecache", "quest"], config=cfg), tmp_path / "b",
                      progress=False)
    got = {r["method"]: r["prediction"] for r in mixed}
    want = {r["method"]: r["prediction"] for r in alone}
    assert got["icecache[page_size=4;field_of_view=6]"] == want["icecache"]
    assert got["quest[page_size=4]"] == want["quest"]


def test_resumed_run_equals_one_shot_run(tmp_path, model):
    tok = CharTokenizer()
    one_shot = run_ruler(model, tok, _spec(tasks=["niah_single_1"]), tmp_path / "a", progress=False)
    run_ruler(model, tok, _spec(tasks=["niah_single_1"], methods=["full"]), tmp_path / "b", progress=False)
    resumed = run_ruler(model, tok, _spec(tasks=["niah_single_1"]), tmp_path / "b", progress=False)
    key = lambda r: (r["method"], r["budget"])
    assert [(key(r), r["prediction"], r["score"]) for r in sorted(one_shot, key=key)] == \
           [(key(r), r["prediction"], r["score"]) for r in sorted(resumed, key=key)]


def test_refuses_a_directory_of_another_run(tmp_path):
    PredictionLog(tmp_path, _spec().signature()).append(_rec("vt", 0, "full", "-", 1.0, length=3000))
    with pytest.raises(ConfigError, match="seed differ"):
        PredictionLog(tmp_path, _spec(seed=1).signature())
    with pytest.raises(ConfigError, match="config differ"):
        PredictionLog(tmp_path, _spec(config=IceCacheConfig(page_size=4)).signature())
    PredictionLog(tmp_path, _spec(samples=9, budgets=[64], methods=["exact"]).signature())  # what to run may grow


def test_a_line_cut_by_a_crash_runs_again(tmp_path):
    log = PredictionLog(tmp_path, _spec().signature())
    log.append({"task": "vt", "length": 3000, "index": 0, "method": "full", "budget": "-", "score": 1.0})
    with open(tmp_path / "predictions.jsonl", "a") as f:
        f.write('{"task": "vt", "length": 3000, "ind')
    assert len(PredictionLog(tmp_path, _spec().signature()).records) == 1


def _rec(task, index, method, budget, score, length=4096):
    return {"task": task, "index": index, "method": method, "budget": budget, "score": score, "length": length}


def test_tables_use_only_samples_every_row_finished():
    recs = [_rec("vt", 0, "full", "-", 1.0), _rec("vt", 1, "full", "-", 0.0), _rec("vt", 0, "icecache", "64", 0.5),
            _rec("cwe", 0, "full", "-", 0.2), _rec("cwe", 0, "icecache", "64", 0.4)]
    scores = complete_scores(recs)[4096]
    assert scores["full"]["vt"] == {0: 1.0}  # sample 1 waits until icecache@64 has it too
    summary = summarize(recs)
    full = next(e for e in summary if e["row"] == "full")
    assert full["tasks"] == {"vt": 100.0, "cwe": 20.0} and math.isclose(full["average"], 60.0)
    table = markdown(summary, ["vt", "cwe"])
    assert "| method | vt | cwe | average |" in table and "| icecache@64 | 50.0 | 40.0 | **45.0**" in table


def test_sample_counts_are_per_task_when_tasks_have_finished_different_numbers():
    """A partial run: vt has 2 samples every row finished, cwe 1; the table says 1-2 and the CSV each task's own."""
    from icecache.eval.ruler.report import results_rows

    recs = [_rec(task, i, method, budget, 1.0) for task, n in (("vt", 2), ("cwe", 1)) for i in range(n)
            for method, budget in (("full", "-"), ("icecache", "64"))]
    summary = summarize(recs)
    assert "(1-2 samples per task;" in markdown(summary, ["vt", "cwe"])
    counts = {(r["method"], r["task"]): r["samples"] for r in results_rows(summary)}
    assert counts[("full", "vt")] == 2 and counts[("full", "cwe")] == 1 and counts[("icecache", "average")] == 1
    assert "(2 samples per task;" in markdown(summarize([r for r in recs if r["task"] == "vt"]), ["vt"])


def test_bootstrap_average_brackets_the_mean_and_needs_two_samples():
    lo, hi = bootstrap_average({"a": [0.0, 1.0, 1.0, 1.0], "b": [0.5, 0.5, 0.5, 0.5]}, seed=3)
    assert lo <= (0.75 + 0.5) / 2 <= hi and 0.25 <= lo and hi <= 0.75
    assert math.isnan(bootstrap_average({"a": [1.0]})[0])
    lo, hi = bootstrap_average({"a": [1.0, 1.0], "b": [0.0, 0.0]})
    assert lo == hi == 0.5  # no spread within tasks: no interval width


def test_plot_accepts_a_degenerate_interval_a_rounding_step_off_the_average(tmp_path):
    """A bootstrap with no spread can put its interval one float step above the average (seen on a partial
    Gemma run: 15.151515151515151 vs [15.151515151515149, ...]); the plot must still be written."""
    from icecache.eval.ruler.report import plot

    avg = 15.151515151515151
    summary = [{"length": 4096, "row": row, "tasks": {"vt": avg}, "average": avg, "ci_low": avg + 1e-12,
                "ci_high": avg - 1e-12, "samples": 2} for row in ("full", "icecache@64")]
    plot(summary, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_plot_of_a_run_without_full_attention_warns_nothing(tmp_path):
    """A run of method variants alone has no full-attention average: the relative panel says so instead of an
    empty legend (matplotlib's "No artists with labels" warning)."""
    import warnings

    from icecache.eval.ruler.report import plot

    summary = [{"length": 8192, "row": "icecache[page_size=4]@64", "tasks": {"vt": 10.0}, "average": 10.0,
                "ci_low": 5.0, "ci_high": 15.0, "samples": 2}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(summary, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_run_json_holds_the_settings(tmp_path):
    log = PredictionLog(tmp_path / "run", _spec().signature())
    assert not (tmp_path / "run").exists()  # nothing is written until a record is
    log.append(_rec("vt", 0, "full", "-", 1.0, length=3000))
    data = json.loads((tmp_path / "run" / "run.json").read_text())
    assert data["seed"] == 42 and data["config"]["page_size"] == 8 and "budget" not in data["config"]


def test_lengths_past_the_models_context_are_refused_before_anything_is_written(tmp_path, model):
    """The tiny model states 8192 positions: a 9000-token run is refused, and its directory is never made."""
    with pytest.raises(ConfigError, match="length 9000 is past the model's context of 8192 tokens"):
        run_ruler(model, CharTokenizer(), _spec(lengths=[3000, 9000]), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


SHARDED_SPEC = dict(model="smollm2-135m-instruct", tasks=["niah_single_1", "vt"], lengths=[1024], samples=2,
                    methods=["full", "icecache", "quest"], budgets=[64])


def assert_sharded_equals_local(tmp_path, smollm2, spec: RulerSpec, sharded: list[dict]) -> None:
    """A local run of ``spec`` on one thread has the same samples, predictions and scores as ``sharded``."""
    model, tok = smollm2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = run_ruler(model, tok, spec, tmp_path / "local", progress=False)
    finally:
        torch.set_num_threads(threads)
    key = lambda r: (r["task"], r["index"], r["method"], r["budget"])
    assert len(local) == len(sharded) == 2 * 2 * 3
    assert [(key(r), r["prediction"], r["score"]) for r in sorted(local, key=key)] == \
           [(key(r), r["prediction"], r["score"]) for r in sorted(sharded, key=key)]


@pytest.mark.slow
def test_ray_run_gives_the_local_runs_records(tmp_path, smollm2):
    """`--ray` (local Ray, two actors of one thread each) against a local run on one thread: the same samples,
    predictions and scores (README: Slow suite; needs the `ray` extra)."""
    pytest.importorskip("ray")
    from icecache.eval.ruler.distributed import run_on_ray

    spec = RulerSpec(**SHARDED_SPEC, config=IceCacheConfig(threads=1))
    assert_sharded_equals_local(tmp_path, smollm2, spec, run_on_ray(spec, tmp_path / "ray", progress=False, workers=2))


@pytest.mark.slow
def test_process_workers_give_the_local_runs_records(tmp_path, smollm2):
    """``--workers 2`` (two spawned processes of one thread each) against a local run on one thread: the same
    samples, predictions and scores, and a second call finds nothing left to do."""
    from icecache.eval.ruler.distributed import run_on_processes

    spec = RulerSpec(**SHARDED_SPEC, config=IceCacheConfig(threads=1))
    sharded = run_on_processes(spec, tmp_path / "workers", 2, progress=False)
    assert_sharded_equals_local(tmp_path, smollm2, spec, sharded)
    assert len(run_on_processes(spec, tmp_path / "workers", 2, progress=False)) == len(sharded)  # resumed: all done


def test_missing_ray_is_refused_in_one_line_naming_what_asked_for_it(tmp_path, monkeypatch):
    import sys

    from icecache.eval.ruler.distributed import run_on_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where it is not installed
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"Ray is not installed: pip install 'icecache\[ray\]' \(--ray"):
        run_on_ray(_spec(), tmp_path / "run", progress=False)
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ConfigError, match="RAY_ADDRESS is set, which sends the run to Ray; unset it"):
        run_on_ray(_spec(), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
