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


def cmd_generate(args: argparse.Namespace) -> int:
    from icecache.runtime.generate import generate_full
    from icecache.runtime.models import load_model

    import time

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    res = generate_full(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, chat=not args.no_chat)
    if args.json:
        print(json.dumps({"text": res.text, "prompt_tokens": res.prompt_tokens, "new_tokens": res.new_tokens,
                          "load_s": load_s, "seconds": res.seconds, "ttft_s": res.ttft_seconds, "tpot_s": res.tpot_seconds}))
        return 0
    print(res.text)
    print(
        f"[full attention] model load {load_s:.1f} s | prompt {res.prompt_tokens} tokens | "
        f"{res.new_tokens} new tokens in {res.seconds:.2f} s (TTFT {res.ttft_seconds:.2f} s, TPOT {1000 * res.tpot_seconds:.1f} ms)",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icecache", description="Memory-efficient KV-cache management for long-sequence decoding.")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="model, config defaults, versions, cache location")
    info.add_argument("--model", default=None, help="model name, .gguf file or model directory (default: the embedded model)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help="model name, .gguf file or model directory (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=cmd_generate)

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
