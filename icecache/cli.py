"""The ``icecache`` command: ``icecache info``, ``icecache generate "..."``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any, Sequence


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

    key = name or models.DEFAULT_MODEL
    info: dict[str, Any] = {"name": key}
    spec = models.MODELS.get(key)
    if spec is None:
        info["source"] = key
        return info
    info["description"] = spec.description
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


def _ice_config(args: argparse.Namespace):
    from icecache.core.config import IceCacheConfig, parse_params

    dense = tuple(int(x) for x in args.dense_layers.split(",") if x.strip()) if args.dense_layers is not None else (0, 1)
    return IceCacheConfig(
        budget=args.budget, page_size=args.page_size, sink=args.sink, window=args.window, index=args.index,
        index_params=parse_params(args.index_params), dense_layers=dense, reuse_every=args.reuse_every,
        threads=args.threads, seed=args.seed, heap_policy=args.heap_policy,
    )


def parse_pager_spec(spec: str) -> tuple[str, dict]:
    """``"mdci"`` -> ``("mdci", {})``; ``"mdci[preset=icecache;field_of_view=120]"`` -> ``("mdci", {...})``
    (the form experiment scripts take in comma-separated lists)."""
    import re

    from icecache.core.config import parse_params
    from icecache.core.errors import ConfigError

    m = re.fullmatch(r"\s*([\w-]+)\s*(?:\[(.*)\])?\s*", spec)
    if m is None:
        raise ConfigError(f"pager spec must be name or name[key=value;...], got {spec!r}")
    return m.group(1), parse_params((m.group(2) or "").replace(";", ","))


def _print_stats(stats: dict, file=sys.stderr) -> None:
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


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from icecache.runtime.generate import generate
    from icecache.runtime.models import load_model

    config = None if args.full else _ice_config(args)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    res = generate(model, tokenizer, args.prompt, config=config, max_new_tokens=args.max_new_tokens,
                   chat=not args.no_chat, return_result=True, progress=not args.json)
    if args.json:
        print(json.dumps({"text": res.text, "prompt_tokens": res.prompt_tokens, "new_tokens": res.new_tokens,
                          "load_s": load_s, "seconds": res.seconds, "ttft_s": res.ttft_seconds,
                          "tt2t_s": res.tt2t_seconds, "tpot_s": res.tpot_seconds, "stats": res.stats}))
        return 0
    print(res.text)
    mode = "full attention" if config is None else f"icecache {config.index} budget {config.budget}"
    print(
        f"[{mode}] model load {load_s:.1f} s | prompt {res.prompt_tokens} tokens | {res.new_tokens} new tokens in "
        f"{res.seconds:.2f} s (TTFT {res.ttft_seconds:.2f} s, TPOT {1000 * res.tpot_seconds:.1f} ms)",
        file=sys.stderr,
    )
    if res.stats:
        _print_stats(res.stats)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A ~4k-token passkey prompt answered with IceCache at a tiny budget."""
    from icecache.eval.passkey import make_passkey, passkey_correct
    from icecache.runtime.generate import generate
    from icecache.runtime.models import load_model

    config = _ice_config(args)
    print(f"loading the embedded model ...", file=sys.stderr)
    model, tokenizer = load_model(args.model)
    sample = make_passkey(tokenizer, args.tokens, depth=args.depth, seed=args.seed)
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
    import time

    from icecache.eval.runner import EvalSpec, markdown, parse_length, run_eval, summarize, write_results
    from icecache.runtime.models import load_model

    t0 = time.perf_counter()
    spec = EvalSpec(
        task=args.task,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        budgets=[int(b) for b in args.budgets.split(",") if b.strip()],
        lengths=[parse_length(x) for x in args.lengths.split(",") if x.strip()],
        samples=args.samples,
        seed=args.seed,
        config=_ice_config(args),
        decode_tokens=args.decode_tokens,
        **({"variants": args.variants.split(",")} if args.variants else {}),
        **({"depths": [float(d) for d in args.depths.split(",")]} if args.depths else {}),
    )
    model, tokenizer = load_model(args.model)
    rows = run_eval(model, tokenizer, spec, progress=not args.json)
    summary = summarize(rows, seed=args.seed)
    wall = time.perf_counter() - t0
    if args.out:
        import shlex

        header = f"Command: `icecache {' '.join(shlex.quote(a) for a in sys.argv[1:])}`\n\nWall time: {wall:.0f} s\n"
        write_results(rows, summary, args.out, header)
    if args.json:
        print(json.dumps({"summary": summary}, default=str))
    else:
        print(markdown(summary))
        print(f"wall time {wall:.0f} s", file=sys.stderr)
    return 0


def _add_ice_options(p: argparse.ArgumentParser, budget: int = 256) -> None:
    g = p.add_argument_group("IceCache")
    g.add_argument("--index", default="mdci", help="pager backend (icecache info lists them; default mdci)")
    g.add_argument("--budget", type=int, default=budget, help=f"middle tokens attended per layer and KV head (default {budget})")
    g.add_argument("--index-params", default=None, metavar="K=V,...",
                   help="parameters of the --index pager, e.g. field_of_view=120,page_score=mass (eval: they tune "
                        "the icecache methods, other methods' pagers keep their defaults)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    g.add_argument("--sink", type=int, default=4, help="first tokens always on the device (default 4)")
    g.add_argument("--window", type=int, default=64, help="recent tokens always on the device (default 64)")
    g.add_argument("--dense-layers", default=None, help="comma-separated layers that keep full KV (default 0,1)")
    g.add_argument("--reuse-every", type=int, default=1, help="IceCache(r): reuse a selection for r layers (default 1)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads for index work (default: all)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--heap-policy", choices=("trim", "pin", "none"), default="trim",
                   help="glibc heap growth over long runs: trim every 256 steps (default), pin the mmap threshold, or none")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icecache", description="Memory-efficient KV-cache management for long-sequence decoding.")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="model, config defaults, versions, cache location")
    info.add_argument("--model", default=None, help="model name, .gguf file or model directory (default: the embedded model)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt with IceCache (or --full)")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--full", action="store_true", help="plain full attention instead of IceCache")
    _add_ice_options(gen)
    gen.add_argument("--model", default=None, help="model name, .gguf file or model directory (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="passkey retrieval from a ~4k-token prompt with IceCache at budget 64")
    demo.add_argument("--model", default=None, help="model (default: the embedded model)")
    demo.add_argument("--tokens", type=_positive_int, default=4096, help="prompt length in tokens (default 4096)")
    demo.add_argument("--depth", type=float, default=0.5, help="relative depth of the key (default 0.5)")
    _add_ice_options(demo, budget=64)
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="accuracy of methods x budgets x lengths on a task (passkey, needle, ppl, longgen)")
    ev.add_argument("task", choices=["passkey", "needle", "ppl", "longgen"])
    ev.add_argument("--methods", default="full,icecache,quest",
                    help="comma-separated: full, exact, icecache, icecache-r, quest, streaming, snapkv, pqcache, icecache:<pager>")
    ev.add_argument("--budgets", default="64,128,256", help="comma-separated budgets (default 64,128,256)")
    ev.add_argument("--lengths", default="2k,4k", help="comma-separated prompt lengths, e.g. 2k,4k,8k (k = 1000 tokens)")
    ev.add_argument("--samples", type=_positive_int, default=5, help="samples per length (and variant)")
    ev.add_argument("--variants", default=None, help="needle variants (default single,multikey,multivalue)")
    ev.add_argument("--depths", default=None, help="passkey depths (default 0.1,0.3,0.5,0.7,0.9)")
    ev.add_argument("--decode-tokens", type=_positive_int, default=256, help="ppl: forced tokens; longgen: generated tokens")
    ev.add_argument("--model", default=None, help="model (default: the embedded model)")
    ev.add_argument("--out", default=None, help="directory for rows.csv, summary.csv, results.json, results.md")
    ev.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_ice_options(ev)
    ev.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="benchmarks: `icecache bench index --help`", add_help=False)
    bench.add_argument("what", choices=["index"], help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "index":
        from icecache.eval.bench_index import main as bench_index_main

        return int(bench_index_main(args.rest) or 0)
    raise AssertionError(args.what)


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    from icecache.core.errors import IceCacheError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except IceCacheError as exc:
        print(f"icecache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
