"""The ``icecache`` command: ``icecache info``, ``icecache generate "..."``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

from icecache.core.config import cli_fields
from icecache.eval.command import positive_int


def _versions() -> dict[str, str]:
    import numpy
    import torch
    import transformers

    import icecache

    return {
        "icecache": icecache.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
    }


def _model_info(name: str | None) -> dict[str, Any]:
    from icecache.runtime import models

    key = models.model_key(name)
    info: dict[str, Any] = {"name": key}
    spec = models.MODELS.get(key)
    if spec is None:
        kind, path, _ = models.resolve_model_source(key)  # an unknown name is refused in one line
        info["source"] = f"{path} ({'GGUF file' if kind == 'gguf' else 'transformers model directory'})"
        return info
    info["description"] = spec.description
    if spec.icecache_settings:
        info["icecache_settings"] = models.model_settings(key)
    info["package"] = f"{spec.package}=={spec.version} (installed with --no-deps, never imported)"
    try:
        gguf = models.locate_gguf(spec)
    except Exception as exc:  # show the fix instead of failing `info`
        info["error"] = str(exc)
        return info
    info["gguf"] = str(gguf)
    cached = sorted((models.cache_root() / "models").glob(f"{gguf.stem}-*/config.json"))
    if cached:
        cfg = json.loads(cached[0].read_text())
        info["converted_copy"] = str(cached[0].parent)
        info["architecture"] = {
            k: cfg.get(k)
            for k in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        }
    else:
        info["converted_copy"] = "not yet (the first load converts the GGUF file, about 20 s)"
    return info


def cmd_info(args: argparse.Namespace) -> int:
    from icecache.core.config import IceCacheConfig
    from icecache.indexes import available_pagers
    from icecache.runtime.models import cache_root

    data = {
        "versions": _versions(),
        "cache": str(cache_root()),
        "model": _model_info(args.model),
        "config_defaults": IceCacheConfig().to_dict(),
        "pagers": available_pagers(),
    }
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("icecache " + data["versions"]["icecache"])
    print("  " + ", ".join(f"{k} {v}" for k, v in data["versions"].items() if k != "icecache"))
    print(f"cache: {data['cache']}   (set ICECACHE_CACHE to move it)")
    print("model:")
    for k, v in data["model"].items():
        print(f"  {k}: {v}")
    print("config defaults: " + ", ".join(f"{k}={v}" for k, v in data["config_defaults"].items()))
    print("pagers: " + ", ".join(data["pagers"]))
    return 0


#: IceCacheConfig fields the command line sets: field -> (flag, value parser, help), generated from the fields'
#: metadata (`icecache.core.config.cli_fields`). Defaults are never restated here: each option's default is None
#: ("not given") and the config's own default applies.
ICE_OPTIONS: dict[str, tuple[str, Any, str]] = {
    f.name: (f.metadata["flag"], f.metadata["parse"], f.metadata["help"]) for f in cli_fields()}


def _config_default(name: str) -> Any:
    from icecache.core.config import IceCacheConfig

    value = getattr(IceCacheConfig(), name)
    if name == "dense_layers":
        return ",".join(map(str, value)) or "''"
    if name == "index_params":
        return "none"
    return value


def given_ice_options(args: argparse.Namespace) -> list[str]:
    """The IceCache flags given explicitly on this command line."""
    return [flag for name, (flag, _, _) in ICE_OPTIONS.items() if getattr(args, name, None) is not None]


def _ice_config(args: argparse.Namespace, check_pager: bool = True, **overrides: Any):
    """The `IceCacheConfig` of the flags given (the config's own defaults for the rest, then ``overrides``).

    ``check_pager``: build one pager with these parameters now, so an unknown index or index parameter fails
    before any model loads (the config alone does not know the registry)."""
    from icecache.core.config import IceCacheConfig
    from icecache.core.errors import ConfigError
    from icecache.core.spec import parse_params

    values: dict[str, Any] = {}
    for name in ICE_OPTIONS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "index_params":
            value = parse_params(value)
        elif name == "dense_layers":
            try:
                value = tuple(int(x) for x in value.split(",") if x.strip())
            except ValueError:
                raise ConfigError(f"--dense-layers: expected comma-separated layer indices, got {value!r}") from None
        values[name] = value
    values.update(overrides)
    for name, value in _model_settings(args, values).items():
        values.setdefault(name, value)
    config = IceCacheConfig(**values)
    if check_pager:
        from icecache.runtime.pager_choice import check_pager_config

        check_pager_config(config, head_dim=8)
    return config


def _model_settings(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """The settings of the ``--model`` (`icecache.runtime.models.model_settings`) that no flag overrides, said in
    one line on stderr when there are any. M-DCI's ``index_params`` apply only where the index is M-DCI's."""
    from icecache.runtime.models import model_settings

    name = getattr(args, "model", None)
    settings = {k: v for k, v in model_settings(name).items() if k not in given}
    if given.get("index", "mdci") != "mdci":  # `auto` takes only its crossover
        settings.pop("index_params", None)
    if settings:
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        print(f"{name}: {shown} (this model's settings, experiments/ruler/README.md; a flag overrides each)",
              file=sys.stderr)
    return settings


def _print_stats(stats: dict, file=sys.stderr) -> None:
    if stats.get("nothing_offloaded"):
        print("nothing offloaded: the prompt fits in sink + window, so this ran like full attention", file=file)
    steps = max(stats.get("steps", 0), 1)
    mib = 2**20
    dev, full = stats["device_kv_bytes"], stats["full_kv_bytes"]
    print(
        f"KV on device: {dev / mib:.1f} MiB vs {full / mib:.1f} MiB for full attention "
        f"({100 * dev / max(full, 1):.1f}%; layers: {stats['layers']}); host (offloaded): {stats['host_kv_bytes'] / mib:.1f} MiB",
        file=file,
    )
    stages = ", ".join(f"{k} {1000 * v / steps:.1f}" for k, v in stats["stage_seconds"].items())
    print(f"per decode step (ms): {stages}", file=file)
    print(
        f"bulk copies per layer step: {stats['copies_per_layer_step']:.2f}, page reuse {100 * stats['page_reuse_rate']:.0f}%, "
        f"index build {stats['index_build_seconds']:.2f} s on worker threads (decode waited {stats['index_wait_seconds']:.2f} s)",
        file=file,
    )
    if "auto_crossover_keys" in stats:
        print(f"index='auto' chose {stats['index']} (crossover {stats['auto_crossover_keys']:,} keys per head on this machine)",
              file=file)


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from icecache.core.errors import ConfigError
    from icecache.runtime.generate import generate
    from icecache.runtime.models import load_model

    if args.full and given_ice_options(args):
        raise ConfigError(f"--full runs plain full attention; {', '.join(given_ice_options(args))} would have no effect")
    config = None if args.full else _ice_config(args)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    res = generate(model, tokenizer, args.prompt, config=config, max_new_tokens=args.max_new_tokens,
                   chat=not args.no_chat, return_result=True, progress=not args.json)
    if args.json:
        print(json.dumps({"text": res.text, "prompt_tokens": res.prompt_tokens, "new_tokens": res.new_tokens,
                          "load_s": load_s, "seconds": res.seconds, "ttft_s": res.ttft_seconds,
                          "tt2t_s": res.tt2t_seconds, "tpot_s": res.tpot_seconds, "chat_template": res.chat_template,
                          "stats": res.stats}))
        return 0
    print(res.text)
    mode = "full attention" if config is None else f"icecache {config.index} budget {config.budget}"
    template = "chat template" if res.chat_template else "raw text, no chat template"
    print(
        f"[{mode}] model load {load_s:.1f} s | prompt {res.prompt_tokens} tokens ({template}) | {res.new_tokens} new tokens in "
        f"{res.seconds:.2f} s (TTFT {res.ttft_seconds:.2f} s, TPOT {1000 * res.tpot_seconds:.1f} ms)",
        file=sys.stderr,
    )
    if res.stats:
        _print_stats(res.stats)
    return 0


#: `icecache demo` answers at this budget unless --budget says otherwise (the headline: IceCache at 64).
DEMO_BUDGET = 64


def cmd_demo(args: argparse.Namespace) -> int:
    """A ~4k-token passkey prompt answered with IceCache at a tiny budget."""
    from icecache.eval.passkey import make_passkey, passkey_correct
    from icecache.runtime.generate import generate
    from icecache.runtime.models import load_model

    config = _ice_config(args, **({} if args.budget is not None else {"budget": DEMO_BUDGET}))
    print("loading the embedded model ...", file=sys.stderr)
    model, tokenizer = load_model(args.model)
    sample = make_passkey(tokenizer, args.tokens, depth=args.depth, seed=config.seed)
    print(f"passkey prompt: {sample.num_tokens} tokens, key hidden at depth {sample.depth:.0%}; "
          f"IceCache index={config.index} budget={config.budget} page_size={config.page_size} "
          f"sink={config.sink} window={config.window}", file=sys.stderr)
    res = generate(model, tokenizer, sample.prompt, config=config, max_new_tokens=8, chat=False,
                   return_result=True, progress=True)
    ok = passkey_correct(sample, res.text)
    print(f"answer: {res.text.strip()!r}   expected: {sample.answer}   -> {'CORRECT' if ok else 'WRONG'}")
    print(f"prefill {res.ttft_seconds:.1f} s, TPOT {1000 * res.tpot_seconds:.0f} ms", file=sys.stderr)
    _print_stats(res.stats, file=sys.stdout)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from icecache.eval.command import check_eval_flags

    check_eval_flags(args, given_ice_options(args))
    if args.task == "ruler" and args.diagnose:  # the run's own config (run.json), not this command line's
        from icecache.eval.ruler.command import run_command

        return run_command(args, None)
    config = _ice_config(args)
    if args.task == "ruler":
        from icecache.eval.ruler.command import run_command

        return run_command(args, config)
    from icecache.eval.command import run_task_command

    return run_task_command(args, config)


def _add_ice_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    g = p.add_argument_group("IceCache (defaults: IceCacheConfig's)")
    for f in cli_fields():
        if f.name in skip:
            continue
        meta = f.metadata
        extra: dict[str, Any] = {"choices": meta["choices"]} if meta["choices"] else {}
        g.add_argument(meta["flag"], dest=f.name, type=meta["parse"], default=None,
                       help=f"{meta['help']} (default {_config_default(f.name)})", **extra)


def _parser(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, allow_abbrev=False, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icecache", allow_abbrev=False,
                                description="Memory-efficient KV-cache management for long-sequence decoding.")
    sub = p.add_subparsers(dest="command", required=True)

    info = _parser(sub, "info", help="model, config defaults, versions, cache location")
    info.add_argument("--model", default=None, help="model name, .gguf file or model directory (default: the embedded model)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    gen = _parser(sub, "generate", help="generate a continuation of a prompt with IceCache (or --full)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--full", action="store_true", help="plain full attention instead of IceCache")
    _add_ice_options(gen)
    gen.add_argument("--model", default=None, help="model name, .gguf file or model directory (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=cmd_generate)

    demo = _parser(sub, "demo", help=f"passkey retrieval from a ~4k-token prompt with IceCache at budget {DEMO_BUDGET}")
    demo.add_argument("--model", default=None, help="model (default: the embedded model)")
    demo.add_argument("--tokens", type=positive_int, default=4096, help="prompt length in tokens (default 4096)")
    demo.add_argument("--depth", type=float, default=0.5, help="relative depth of the key (default 0.5)")
    _add_ice_options(demo)
    demo.set_defaults(func=cmd_demo)

    from icecache.eval.command import add_eval_arguments

    ev = _parser(sub, "eval", help="accuracy of methods x budgets x lengths on a task (passkey, needle, ppl, longgen, ruler)")
    add_eval_arguments(ev)
    _add_ice_options(ev, skip=("budget",))
    ev.add_argument("--budget", dest="budget", default=None, help=argparse.SUPPRESS)  # refused: eval takes --budgets
    ev.set_defaults(func=cmd_eval)

    bench = _parser(sub, "bench", help="benchmarks (icecache bench index --help)")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    index = _parser(bench_sub, "index", help="pager quality and speed on captured real keys", add_help=False)
    index.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see --help)")
    index.set_defaults(func=cmd_bench)

    for name, text in (("sim", "the timing simulator (icecache sim --help; same as python -m icecache.sim)"),
                       ("calibrate", "measure this machine and write a simulator profile (icecache calibrate --help)")):
        forward = _parser(sub, name, help=text, add_help=False)
        forward.add_argument("rest", nargs=argparse.REMAINDER)
        forward.set_defaults(func=cmd_sim if name == "sim" else cmd_calibrate)
    return p


def _bench_index(argv: list[str]) -> int:
    from icecache.measure.bench_index import main as bench_index_main

    return bench_index_main(argv)


def _sim(argv: list[str]) -> int:
    from icecache.sim.cli import main as sim_main

    return sim_main(argv)


def _calibrate(argv: list[str]) -> int:
    from icecache.measure.calibrate import main as calibrate_main

    return calibrate_main(argv)


#: Leading words -> the entry point that parses the rest itself.
FORWARDED = {("bench", "index"): _bench_index, ("sim",): _sim, ("calibrate",): _calibrate}


def cmd_bench(args: argparse.Namespace) -> int:  # reached only through --help listings; see FORWARDED
    return _bench_index(args.rest)


def cmd_sim(args: argparse.Namespace) -> int:
    return _sim(args.rest)


def cmd_calibrate(args: argparse.Namespace) -> int:
    return _calibrate(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``icecache``: our errors are one line on stderr (exit 2), Ctrl-C exits 130 quietly."""
    from icecache.core.errors import run_reporting_errors

    argv = list(sys.argv[1:] if argv is None else argv)
    forwarded = FORWARDED.get(tuple(argv[:2])) or FORWARDED.get(tuple(argv[:1]))
    if forwarded is not None:  # commands with parsers (and error reporting) of their own get their arguments untouched
        return forwarded(argv[2:] if tuple(argv[:2]) in FORWARDED else argv[1:])
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
