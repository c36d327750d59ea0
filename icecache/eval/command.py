"""``icecache eval``: its arguments, which of them each task takes, and the run of the classic tasks.

Every flag either reaches the run or is refused with a one-line `ConfigError`: flags of another task, a
``--budget`` (eval compares ``--budgets``), and ``--index``/``--index-params`` when no method uses the
configured pager (they tune ``icecache`` and ``icecache-r`` only; the other methods run fixed pagers).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

from icecache.core.errors import ConfigError
from icecache.core.spec import parse_spec, split_items

TASKS = ("passkey", "needle", "ppl", "longgen", "ruler")
#: Methods that run the configured pager (``--index``, ``--index-params``).
CONFIGURED_PAGER_METHODS = ("icecache", "icecache-r")
#: methods whose pages the step's query selects, so that `IceCacheConfig.top_p` applies (streaming and snapkv
#: drop it: `methods.py`)
QUERY_SELECTING_METHODS = ("exact", "icecache", "icecache-r", "quest", "pqcache")
#: Task-specific flags: dest -> (flag, tasks that take it, value meaning "not given").
TASK_FLAGS: dict[str, tuple[str, tuple[str, ...], Any]] = {
    "variants": ("--variants", ("needle",), None),
    "depths": ("--depths", ("passkey",), None),
    "decode_tokens": ("--decode-tokens", ("ppl", "longgen"), None),
    "tasks": ("--tasks", ("ruler",), None),
    "kvpress": ("--kvpress", ("ruler",), None),
    "ray": ("--ray", ("ruler",), False),
    "workers": ("--workers", ("ruler",), None),
    "data_seed": ("--data-seed", ("ruler",), None),
    "no_chat_template": ("--no-chat-template", ("ruler",), False),
    "diagnose": ("--diagnose", ("ruler",), None),
    "references": ("--references", ("ruler",), None),
}
DEFAULT_DECODE_TOKENS = 256


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse's one-line error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_eval_arguments(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("task", choices=TASKS)
    ev.add_argument("--methods", default="full,icecache,quest",
                    help="comma-separated: full, exact, icecache, icecache-r, quest, streaming, snapkv, pqcache, icecache:<pager>, "
                         "or a variant with its own settings, e.g. icecache[page_size=4;field_of_view=200] or quest[page_size=4]")
    ev.add_argument("--budgets", default="64,128,256", help="comma-separated budgets (default 64,128,256)")
    ev.add_argument("--lengths", default=None,
                    help="comma-separated lengths, e.g. 2k,4k,8k (default 2k,4k; k = 1000 tokens, ruler: 1024 and default 4k)")
    ev.add_argument("--samples", type=positive_int, default=5, help="samples per length (and variant or task)")
    ev.add_argument("--model", default=None, help="model (default: the embedded model)")
    ev.add_argument("--out", default=None, help="directory for the results (ruler: predictions.jsonl, results.*)")
    ev.add_argument("--json", action="store_true", help="print the summary as JSON")
    task = ev.add_argument_group("task-specific")
    task.add_argument("--variants", default=None, help="needle: variants (default single,multikey,multivalue)")
    task.add_argument("--depths", default=None, help="passkey: depths (default 0.1,0.3,0.5,0.7,0.9)")
    task.add_argument("--decode-tokens", type=positive_int, default=None,
                      help=f"ppl: forced tokens; longgen: generated tokens (default {DEFAULT_DECODE_TOKENS})")
    task.add_argument("--tasks", default=None, help="ruler: comma-separated RULER tasks or 'all' (default all)")
    task.add_argument("--kvpress", default=None, metavar="PRESS,...",
                      help="ruler: kvpress presses as extra rows at each budget (snapkv, streaming, expected_attention, knorm)")
    task.add_argument("--ray", action="store_true", help="ruler: shard the samples as Ray tasks (also when RAY_ADDRESS is set)")
    task.add_argument("--workers", type=positive_int, default=None,
                      help="ruler: answer samples on N local processes of cpu_count/N torch threads each (default: this "
                           "process; on 2 cores 2 workers finished about twice the samples per minute); with --ray, the number of actors")
    task.add_argument("--data-seed", type=int, default=None, help="ruler: seed of the generated samples (default 42, RULER's)")
    task.add_argument("--diagnose", default=None, metavar="METHOD@BUDGET,...",
                      help="ruler: classify the samples these rows of the --out run lost (model, budget, page or search miss)")
    task.add_argument("--references", default=None, metavar="DIR",
                      help="ruler --diagnose: take full's and exact's rows from this run of the same samples")
    task.add_argument("--no-chat-template", action="store_true",
                      help="ruler: plain prompts even when the tokenizer has a chat template")


def check_eval_flags(args: argparse.Namespace, given_ice: list[str]) -> None:
    """Refuse flags that would have no effect on this run (see the module docstring)."""
    if args.budget is not None:
        raise ConfigError("eval compares --budgets (comma-separated); --budget does not apply")
    if getattr(args, "diagnose", None):
        ignored = [f for f in given_ice if f != "--threads"] + [
            flag for dest, (flag, _, unset) in TASK_FLAGS.items()
            if dest not in ("diagnose", "references") and getattr(args, dest) != unset]
        if ignored:
            raise ConfigError(f"--diagnose replays the --out run with its own settings (its run.json); "
                              f"{', '.join(ignored)} would have no effect (--threads applies)")
    for dest, (flag, tasks, unset) in TASK_FLAGS.items():
        if getattr(args, dest) != unset and args.task not in tasks:
            raise ConfigError(f"{flag} applies to eval {'/'.join(tasks)}, not to eval {args.task}")
    methods = [parse_spec(m)[0] for m in split_items(args.methods)]  # a variant name[...] is its base's
    pager_flags = [f for f in given_ice if f in ("--index", "--index-params")]
    if pager_flags and not any(m in CONFIGURED_PAGER_METHODS for m in methods):
        raise ConfigError(f"{' and '.join(pager_flags)} {'tune' if len(pager_flags) > 1 else 'tunes'} the methods {', '.join(CONFIGURED_PAGER_METHODS)}; "
                          f"none of --methods {args.methods} uses them")
    if "--top-p" in given_ice and not any(m in QUERY_SELECTING_METHODS or m.startswith("icecache:") for m in methods):
        raise ConfigError(f"--top-p cuts the pages the step's query selects ({', '.join(QUERY_SELECTING_METHODS)}, "
                          f"icecache:<pager>); none of --methods {args.methods} selects by query")
    if given_ice and methods == ["full"]:
        rows = "plain full attention" + (" and kvpress's presses" if getattr(args, "kvpress", None) else "")
        raise ConfigError(f"--methods full runs {rows}; {', '.join(given_ice)} would have no effect")


def _lengths(text: str) -> list[int]:
    from icecache.eval.runner import parse_length

    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            out.append(parse_length(item))
        except ValueError:
            raise ConfigError(f"--lengths: expected token counts like 2k or 4096, got {item!r}") from None
    return out


def build_spec(args: argparse.Namespace, config: Any) -> Any:
    """The `EvalSpec` of an ``eval passkey|needle|ppl|longgen`` command line."""
    from icecache.eval.runner import EvalSpec

    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        depths = [float(d) for d in args.depths.split(",")] if args.depths else None
    except ValueError:
        raise ConfigError(f"--budgets/--depths: expected comma-separated numbers, got {args.budgets!r} / {args.depths!r}") from None
    try:
        return EvalSpec(
            task=args.task, methods=[m.strip() for m in args.methods.split(",") if m.strip()], budgets=budgets,
            lengths=_lengths(args.lengths or "2k,4k"), samples=args.samples, seed=config.seed, config=config,
            decode_tokens=args.decode_tokens or DEFAULT_DECODE_TOKENS,
            **({"variants": args.variants.split(",")} if args.variants else {}),
            **({"depths": depths} if depths else {}),
        )
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None


def run_task_command(args: argparse.Namespace, config: Any) -> int:
    """``icecache eval passkey|needle|ppl|longgen`` with the `IceCacheConfig` of the command line; Ctrl-C
    keeps and writes the finished rows."""
    from icecache.eval.runner import markdown, run_eval, summarize, write_results
    from icecache.runtime.models import load_model

    t0 = time.perf_counter()
    spec = build_spec(args, config)
    model, tokenizer = load_model(args.model)
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        run_eval(model, tokenizer, spec, progress=not args.json, rows=rows)
    except KeyboardInterrupt:
        interrupted = True
    summary = summarize(rows, seed=spec.seed)
    wall = time.perf_counter() - t0
    if args.out and rows:
        header = (f"Command: `icecache {' '.join(shlex.quote(a) for a in sys.argv[1:])}`\n\n"
                  f"Wall time: {wall:.0f} s{' (interrupted: the rows finished before Ctrl-C)' if interrupted else ''}\n")
        write_results(rows, summary, args.out, header)
    if args.json:
        print(json.dumps({"summary": summary, "interrupted": interrupted}, default=str))
    else:
        print(markdown(summary))
        print(f"wall time {wall:.0f} s", file=sys.stderr)
    if interrupted:
        where = f"; written to {args.out}" if args.out and rows else ""
        print(f"interrupted: {len(rows)} finished rows kept{where}", file=sys.stderr)
        return 130
    return 0
