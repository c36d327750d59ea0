"""The command line: every IceCache flag reaches the config (and through eval's methods, the cache), flags that
would have no effect are refused in one line, bad input never prints a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_llama
from test_ruler_runner import CharTokenizer

from icecache import IceCacheConfig
from icecache.cli import ICE_OPTIONS, _ice_config, build_parser, main
from icecache.core.errors import ConfigError
from icecache.eval.harness import run_prefill
from icecache.eval.methods import get_method

#: A value for each IceCache flag that differs from the config default, and the field value it must give.
FLAG_VALUES = {
    "--index": ("ivf", "ivf"),
    "--budget": ("48", 48),
    "--index-params": ("page_score=mass", {"page_score": "mass"}),
    "--page-size": ("8", 8),
    "--sink": ("2", 2),
    "--window": ("24", 24),
    "--dense-layers": ("1,3", (1, 3)),
    "--reuse-every": ("2", 2),
    "--threads": ("1", 1),
    "--seed": ("7", 7),
    "--heap-policy": ("none", "none"),
    "--inserts": ("inline", "inline"),
    "--insert-every": ("8", 8),
    "--top-p": ("0.9", 0.9),
}


def test_every_config_flag_is_tested_and_has_no_restated_default():
    assert set(FLAG_VALUES) == {flag for flag, _, _ in ICE_OPTIONS.values()}
    args = build_parser().parse_args(["generate", "hi"])
    assert all(getattr(args, name) is None for name in ICE_OPTIONS)  # defaults come from IceCacheConfig
    assert _ice_config(args) == IceCacheConfig()


@pytest.mark.parametrize("flag", sorted(FLAG_VALUES))
@pytest.mark.parametrize("command", ["generate", "demo", "eval"])
def test_each_flag_reaches_the_config(command, flag):
    text, expected = FLAG_VALUES[flag]
    if command == "eval" and flag == "--budget":
        pytest.skip("eval takes --budgets (refusal tested below)")
    argv = {"generate": ["generate", "hi"], "demo": ["demo"], "eval": ["eval", "passkey"]}[command]
    args = build_parser().parse_args([*argv, flag, text])
    field = next(name for name, (f, _, _) in ICE_OPTIONS.items() if f == flag)
    config = _ice_config(args)
    assert getattr(config, field) == expected
    others = {n: getattr(config, n) for n in ICE_OPTIONS if n != field}
    assert others == {n: getattr(IceCacheConfig(), n) for n in others}


def test_index_params_are_checked_before_any_model_loads():
    args = build_parser().parse_args(["generate", "hi", "--index", "ivf", "--index-params", "nprob=2"])
    with pytest.raises(ConfigError, match="nprob"):
        _ice_config(args)
    args = build_parser().parse_args(["generate", "hi", "--index", "ivf", "--index-params", "nprobe=2"])
    assert _ice_config(args).index_params == {"nprobe": 2}


@pytest.fixture(scope="module")
def prefill_and_model():
    model = make_tiny_llama(seed=3)
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    return model, run_prefill(model, ids, obs_window=16)


def _cache_config(model, prefill, method: str, argv: list[str]):
    args = build_parser().parse_args(["eval", "passkey", "--methods", method, *argv])
    cache = get_method(method).cache(model, prefill, _ice_config(args).replace(budget=16))
    try:
        pager = cache.layers[2].pagers[0][0]
        return cache.ice, pager
    finally:
        cache.close()


def test_eval_index_and_params_reach_the_icecache_methods(prefill_and_model):
    """`eval --index ivf --index-params nprobe=2` runs IVF with nprobe 2 (it used to run M-DCI, silently)."""
    model, prefill = prefill_and_model
    for method in ("icecache", "icecache-r"):
        ice, pager = _cache_config(model, prefill, method, ["--index", "ivf", "--index-params", "nprobe=2", "--dense-layers", "0"])
        assert ice.index == "ivf" and ice.index_params == {"nprobe": 2}
        assert type(pager).__name__ == "IVFPager" and pager.nprobe == 2
    ice, pager = _cache_config(model, prefill, "icecache", ["--dense-layers", "0"])
    assert ice.index == "mdci" and type(pager).__name__ == "MDCIPager"
    # the fixed-pager methods keep their pager and its defaults
    ice, pager = _cache_config(model, prefill, "quest", ["--dense-layers", "0"])
    assert ice.index == "sequential" and ice.index_params == {}


def test_eval_command_runs_the_pager_its_index_flags_name(monkeypatch, capsys):
    """``icecache eval`` itself, from its command line through `build_spec`, `EvalSpec` and `run_eval` to the
    caches: ``--index mdci --index-params field_of_view=7 --page-size 4`` make every sparse layer's pagers M-DCI
    with field of view 7 and pages of 4 (the test above starts from the config and skips that path)."""
    import icecache.runtime.models as models
    from icecache.runtime.pager_choice import PagerChoice

    made = []
    real_make = PagerChoice.make
    monkeypatch.setattr(PagerChoice, "make", lambda self, *a: made.append(real_make(self, *a)) or made[-1])
    monkeypatch.setattr(models, "load_model", lambda name=None: (make_tiny_llama(seed=3), CharTokenizer()))
    assert main(["eval", "ppl", "--methods", "icecache", "--budgets", "16", "--lengths", "160", "--samples", "1",
                 "--decode-tokens", "2", "--index", "mdci", "--index-params", "field_of_view=7", "--page-size", "4",
                 "--dense-layers", "0", "--window", "16", "--threads", "1", "--json"]) == 0
    assert '"method": "icecache"' in capsys.readouterr().out
    ran = [p for p in made if len(p)]  # the layers' pagers, holding the prompt's keys (the config checks make empty ones)
    assert len(ran) == 3 * 2  # sparse layers 1-3, 2 KV heads each
    assert {(type(p).__name__, p.params.query.field_of_view, p.page_size) for p in ran} == {("MDCIPager", 7, 4)}


@pytest.mark.parametrize("method", ["exact", "icecache", "icecache-r", "quest", "pqcache", "streaming", "snapkv"])
def test_shared_fields_reach_every_method(prefill_and_model, method):
    model, prefill = prefill_and_model
    argv = ["--page-size", "8", "--sink", "2", "--window", "24", "--dense-layers", "0,3", "--threads", "1", "--seed", "5",
            "--heap-policy", "none", "--reuse-every", "3", "--top-p", "0.8"]
    ice, _ = _cache_config(model, prefill, method, argv)
    assert ice.top_p == (None if method in ("streaming", "snapkv") else 0.8)  # their pages are not the query's
    expected_window = 24 + 16 if method == "streaming" else 24  # streaming: the budget slots join the window
    assert (ice.page_size, ice.sink, ice.window, ice.dense_layers) == (8, 2, expected_window, (0, 3))
    assert (ice.threads, ice.seed, ice.heap_policy, ice.reuse_every) == (1, 5, "none", 3)


def test_icecache_r_reuses_two_layers_unless_told_otherwise(prefill_and_model):
    model, prefill = prefill_and_model
    assert _cache_config(model, prefill, "icecache-r", [])[0].reuse_every == 2
    assert _cache_config(model, prefill, "icecache-r", ["--reuse-every", "4"])[0].reuse_every == 4


@pytest.mark.parametrize("argv, message", [
    (["eval", "passkey", "--budget", "64"], "--budget does not apply"),
    (["eval", "passkey", "--index", "ivf", "--methods", "full,quest"], "none of --methods"),
    (["eval", "passkey", "--index-params", "nprobe=2", "--methods", "exact"], "none of --methods"),
    (["eval", "passkey", "--window", "32", "--methods", "full"], "no effect"),
    (["eval", "ruler", "--methods", "full", "--kvpress", "snapkv", "--threads", "1", "--out", "unused"],
     "runs plain full attention and kvpress's presses; --threads would have no effect"),
    (["eval", "passkey", "--top-p", "0.9", "--methods", "full,snapkv,streaming"], "none of --methods"),
    (["generate", "hi", "--top-p", "1.5"], "IceCacheConfig.top_p must be None or a number in (0, 1]"),
    (["eval", "passkey", "--variants", "single"], "applies to eval needle"),
    (["eval", "needle", "--depths", "0.5"], "applies to eval passkey"),
    (["eval", "passkey", "--decode-tokens", "9"], "applies to eval ppl/longgen"),
    (["eval", "needle", "--tasks", "vt"], "applies to eval ruler"),
    (["eval", "passkey", "--workers", "2"], "applies to eval ruler"),
    (["eval", "ruler", "--variants", "single", "--out", "unused"], "applies to eval needle"),
    (["eval", "passkey", "--references", "unused"], "applies to eval ruler"),
    (["eval", "ruler", "--references", "unused", "--out", "unused"], "does nothing without it"),
    (["eval", "ruler", "--diagnose", "icecache@256", "--page-size", "16", "--threads", "1", "--out", "unused"],
     "its own settings (its run.json); --page-size would have no effect"),
    (["eval", "ruler", "--diagnose", "icecache@256", "--tasks", "vt", "--out", "unused"], "--tasks would have no effect"),
    (["eval", "passkey", "--lengths", "2q"], "--lengths: expected"),
    (["eval", "ruler", "--lengths", "2q", "--out", "unused"], "--lengths: expected"),
    (["eval", "ruler", "--tasks", "nope", "--out", "unused"], "unknown ['nope']"),
    (["eval", "ruler", "--methods", "full"], "needs --out"),
    (["eval", "passkey", "--methods", "fulll"], "unknown method"),
    (["generate", "hi", "--full", "--budget", "3"], "--full runs plain full attention"),
    (["generate", "hi", "--index-params", "bogus=1"], "no parameter 'bogus'"),
    (["generate", "hi", "--dense-layers", "a"], "--dense-layers"),
    (["generate", "hi", "--index", "nope"], "nope"),
    (["generate", "hi", "--index", "auto", "--index-params", "nprobe=4"], "pager 'auto' has no parameter 'nprobe'"),
    (["generate", "hi", "--index", "auto", "--index-params", "crossover=-5"], "crossover must be an int >= 0"),
])
def test_refused_in_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("icecache: error:") and message in err and "\n" not in err and "Traceback" not in err


def test_ruler_refuses_an_unknown_model_before_writing(tmp_path, capsys):
    """A mistyped --model is refused in one line and leaves no half-made run directory behind."""
    out = tmp_path / "run"
    assert main(["eval", "ruler", "--model", "no-such-model", "--methods", "full", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("icecache: error: unknown model 'no-such-model'") and "\n" not in err
    assert not out.exists()


def test_no_prefix_abbreviations():
    """`--budget` must not silently mean `--budgets` (argparse's prefix matching is off)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "passkey", "--samp", "3"])


def _long_options(parser) -> list[tuple[object, str]]:
    """``(parser, option)`` for every ``--option`` of ``parser`` and its sub-commands."""
    found = []
    for action in parser._actions:
        found += [(parser, o) for o in action.option_strings if o.startswith("--") and o != "--help"]
        if isinstance(getattr(action, "choices", None), dict):
            for sub in action.choices.values():
                found += _long_options(sub)
    return found


def test_no_command_takes_an_abbreviated_option():
    """The simulator, `bench index` and `calibrate` parsers refuse a prefix of an option as the main one does."""
    from icecache.measure.bench_index.cli import build_parser as bench_parser
    from icecache.measure.calibrate import build_parser as calibrate_parser
    from icecache.sim.cli import build_parser as sim_parser

    checked = 0
    for build in (sim_parser, bench_parser, calibrate_parser, build_parser):
        for parser, option in _long_options(build()):
            taken = {o for _, o in _long_options(parser)}
            prefix = option[:-1]
            if len(prefix) > 3 and prefix not in taken:
                assert parser._parse_optional(prefix) is None or parser._parse_optional(prefix)[0] is None, \
                    f"{parser.prog} takes {prefix} for {option}"
                checked += 1
    assert checked > 50


def test_bench_help_prints_help_without_arguments():
    for argv in (["bench", "--help"], ["bench", "index", "--help"]):
        out = subprocess.run([sys.executable, "-m", "icecache.cli", *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout and "Traceback" not in out.stderr


def test_ctrl_c_during_eval_keeps_the_finished_rows(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of `icecache eval`: the rows finished before it are written, the console says
    "interrupted", and there is no traceback (exit code 130)."""
    import icecache.eval.runner as runner
    import icecache.runtime.models as models

    row = {"task": "passkey", "variant": "filler", "length": 600, "tokens": 600, "sample": 0, "method": "full",
           "budget": "-", "score": 1.0, "output": "12345", "answer": "12345", "depth": 0.5, "seconds": 1.0,
           "prefill_seconds": 1.0}

    def interrupted_run(model, tokenizer, spec, progress=True, rows=None):
        rows.append(dict(row))
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", lambda name=None: (None, None))
    monkeypatch.setattr(runner, "run_eval", interrupted_run)
    out = tmp_path / "eval"
    assert main(["eval", "passkey", "--methods", "full", "--lengths", "600", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "interrupted: 1 finished rows kept" in err and "Traceback" not in err
    assert "full" in (out / "rows.csv").read_text() and "interrupted" in (out / "results.md").read_text()


def test_generate_stats_line_says_which_prompt_convention_ran(capsys, monkeypatch):
    import icecache.runtime.generate as generate_module
    import icecache.runtime.models as models
    from icecache.runtime.generate import GenerationResult

    def fake_generate(model, tokenizer, prompt, *, config=None, chat=None, **kw):
        return GenerationResult(text="ok", prompt_tokens=3, new_tokens=1, seconds=0.1, ttft_seconds=0.1,
                                chat_template=bool(chat), stats={})

    monkeypatch.setattr(models, "load_model", lambda name=None: (None, None))
    monkeypatch.setattr(generate_module, "generate", fake_generate)
    assert main(["generate", "hi", "--full"]) == 0
    assert "(chat template)" in capsys.readouterr().err
    assert main(["generate", "hi", "--full", "--no-chat"]) == 0
    assert "(raw text, no chat template)" in capsys.readouterr().err


GEMMA3 = {"fov_scale": 0.024, "fov_min": 200, "fov_max": 400}


@pytest.mark.parametrize(("argv", "page_size", "index", "index_params"), [
    ([], 4, "mdci", GEMMA3),  # the model's settings
    (["--page-size", "16"], 16, "mdci", GEMMA3),  # a flag overrides its field only
    (["--index-params", ""], 4, "mdci", {}),  # an empty --index-params is a given value
    (["--index", "ivf"], 4, "ivf", {}),  # M-DCI's parameters stay with M-DCI
    (["--index", "auto"], 4, "auto", {}),  # auto takes only its crossover
])
def test_a_models_settings_fill_the_fields_no_flag_sets(capsys, argv, page_size, index, index_params):
    args = build_parser().parse_args(["eval", "passkey", "--model", "gemma-3-270m", *argv])
    config = _ice_config(args)  # the pager check too: the settings must be valid for the index they reach
    assert (config.page_size, config.index, config.index_params) == (page_size, index, index_params)
    assert config.budget == IceCacheConfig().budget
    line = capsys.readouterr().err.strip()
    assert line.startswith("gemma-3-270m: ") and "this model's settings" in line
    assert ("page_size=4" in line) == (page_size == 4)


def test_models_without_settings_keep_the_configs_defaults(capsys):
    from icecache.runtime.models import MODELS, model_settings

    for argv in (["generate", "hi"], ["eval", "passkey", "--model", "smollm2"], ["generate", "hi", "--model", "/tmp/x"]):
        assert _ice_config(build_parser().parse_args(argv), check_pager=False) == IceCacheConfig()
    assert capsys.readouterr().err == ""
    settings = model_settings("gemma-3-270m")
    settings["index_params"]["fov_min"] = 1  # a copy: the registry keeps its own
    assert MODELS["gemma-3-270m"].icecache_settings["index_params"] == GEMMA3
    assert IceCacheConfig(**model_settings("gemma-3-270m")).page_size == 4


def test_pager_flags_count_a_variant_as_its_base_method():
    """`--index-params` tunes `icecache[...]` (a variant runs its base's pager) and not `quest[...]`."""
    from icecache.eval.command import check_eval_flags

    def args(methods: str) -> argparse.Namespace:
        return build_parser().parse_args(["eval", "ruler", "--methods", methods, "--index-params", "", "--out", "unused"])

    check_eval_flags(args("icecache[field_of_view=200],quest[page_size=4]"), ["--index-params"])
    with pytest.raises(ConfigError, match="none of --methods"):
        check_eval_flags(args("quest[page_size=4],full"), ["--index-params"])
