"""``icecache eval ruler --out DIR --diagnose icecache@256,...``: classify a finished run's lost samples.

Reads ``DIR/run.json`` (the run's model, data seed, chat template and `IceCacheConfig`) and
``DIR/predictions.jsonl``; replays every sample that a ``method@budget`` lost while full attention and the
exact oracle both scored higher (`icecache.eval.ruler.diagnose`), one prefill per sample for all the targets.
Each classified sample is appended to ``DIR/diagnosis.jsonl`` as it finishes; a re-run re-classifies the rows
there from their scores and replays only what they lack, and the file is rewritten with one row per sample at
the end. ``DIR/diagnosis.md`` holds
the class counts per length and ``method@budget``, and how many samples scored below full attention's own
(partial) score.

``--references RUN`` takes the full and exact rows from another run of the same samples (same model, data
seed, chat template and every `IceCacheConfig` field that full attention and the exact oracle use), for a run
of variants alone (``--methods "icecache[page_size=4]"``) that did not repeat them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError, UnknownNameError

CLASSES = ("model", "budget", "page miss", "search miss")


def parse_targets(text: str) -> list[tuple[str, str]]:
    """``"icecache@256,quest@64"`` -> ``[("icecache", "256"), ("quest", "64")]``; one-line `ConfigError` otherwise."""
    from icecache.core.spec import split_items
    from icecache.eval.methods import get_method

    out = []
    for item in split_items(text):
        method, sep, budget = item.rpartition("@")
        if not sep or not method or not budget.isdigit():
            raise ConfigError(f"--diagnose: expected METHOD@BUDGET like icecache@256, got {item!r}")
        if method in ("full", "exact"):
            raise ConfigError(f"--diagnose: {method} is a reference of the classification, not a method to diagnose")
        try:
            get_method(method)
        except UnknownNameError as err:
            raise ConfigError(f"--diagnose: {err}") from None
        out.append((method, str(int(budget))))
    if not out:
        raise ConfigError("--diagnose: expected METHOD@BUDGET like icecache@256")
    return out


def diagnosis_markdown(records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
                       targets: Sequence[tuple[str, str]]) -> str:
    """Class counts per length and target: lost samples, how many were classified, and each class."""
    from icecache.eval.ruler.diagnose import row_key

    scores = {row_key(r): r["score"] for r in records}
    lines = ["| length | method@budget | samples | lost | classified | " + " | ".join(CLASSES)
             + " | search / pages / oracle answer recall (misses) | below full (exact too) |",
             "|---|---|---|---|---|" + "---|" * len(CLASSES) + "---|---|"]
    for length in sorted({int(r["length"]) for r in records}):
        for method, budget in targets:
            mine = [r for r in records if int(r["length"]) == length and r["method"] == method and str(r["budget"]) == budget]
            if not mine:
                continue
            lost = sum(r["score"] < 1.0 for r in mine)
            done = [d for d in rows if int(d["length"]) == length and d["method"] == method and d["budget"] == budget]
            counts = Counter(d["class"] for d in done)
            replays = [d for d in done if d["class"] in ("page miss", "search miss") and "search_recall" in d]
            recall = (" / ".join(f"{sum(d[k] for d in replays) / len(replays):.2f}" for k in ("search_recall", "pages_recall", "oracle_recall"))
                      if replays else "-")
            below, oracle_below = _below_full(mine, scores, budget)
            lines.append(f"| {length} | {method}@{budget} | {len(mine)} | {lost} | {len(done)} | "
                         + " | ".join(str(counts.get(c, 0)) for c in CLASSES) + f" | {recall} | {below} ({oracle_below}) |")
    return "\n".join(lines) + "\n"


def _below_full(mine: Sequence[dict[str, Any]], scores: dict[tuple[str, ...], float], budget: str) -> tuple[int, int]:
    """How many of ``mine`` scored below full attention on the same sample (partial credit counts: a sample
    full answers half of and the method none of is below), and of those, how many the exact oracle at the same
    budget also scored below full. Samples full has not run are left out."""
    from icecache.eval.ruler.diagnose import row_key

    below = oracle_below = 0
    for r in mine:
        key = row_key(r)[:3]  # (task, length, index)
        full = scores.get((*key, "full", "-"))
        if full is None or r["score"] >= full:
            continue
        below += 1
        oracle = scores.get((*key, "exact", budget))
        oracle_below += oracle is not None and oracle < full
    return below, oracle_below


#: `IceCacheConfig` fields that neither full attention nor the exact oracle (every token its own page) reads:
#: a reference run may differ in these.
REFERENCE_FREE_FIELDS = ("page_size", "index", "index_params")


def reference_records(run: dict[str, Any], records: Sequence[dict[str, Any]], ref_dir: Path) -> list[dict[str, Any]]:
    """The full and exact rows of the run in ``ref_dir``, checked to answer the same samples as ``run`` (model,
    data seed, chat template, the config fields the references read); one-line `ConfigError` otherwise."""
    from icecache.eval.ruler.runner import read_jsonl

    ref_file = ref_dir / "run.json"
    if not ref_file.exists():
        raise ConfigError(f"--references: {ref_file} not found; it must be a RULER run's directory")
    ref = json.loads(ref_file.read_text())
    for key in ("model", "seed", "chat_template"):
        if ref.get(key) != run.get(key):
            raise ConfigError(f"--references: {ref_dir} ran {key} {ref.get(key)!r}, the diagnosed run {run.get(key)!r}")
    differ = sorted(k for k in set(ref["config"]) | set(run["config"])
                    if k not in REFERENCE_FREE_FIELDS and ref["config"].get(k) != run["config"].get(k))
    if differ:
        raise ConfigError(f"--references: {ref_dir} ran another config ({', '.join(differ)} differ)")
    own = sorted({r["method"] for r in records if r["method"] in ("full", "exact")})
    if own:
        raise ConfigError(f"--references: the diagnosed run holds its own {' and '.join(own)} rows; diagnose it without --references")
    rows = [r for r in read_jsonl(ref_dir / "predictions.jsonl") if r["method"] in ("full", "exact")]
    if not rows:
        raise ConfigError(f"--references: {ref_dir} holds no full or exact rows")
    return rows


def run_diagnose(args: Any) -> int:
    """Entry point of ``icecache eval ruler --diagnose`` (see the module docstring)."""
    from icecache.core.config import IceCacheConfig
    from icecache.eval.ruler.diagnose import diagnose_targets, row_key
    from icecache.eval.ruler.runner import read_jsonl
    from icecache.runtime.models import load_model, model_key

    if not args.out:
        raise ConfigError("--diagnose needs --out DIR, the directory of a RULER run")
    out = Path(args.out)
    run_file = out / "run.json"
    if not run_file.exists():
        raise ConfigError(f"--diagnose: {run_file} not found; --out must be a RULER run's directory")
    targets = parse_targets(args.diagnose)
    run = json.loads(run_file.read_text())
    if args.model and model_key(args.model) != run["model"]:
        raise ConfigError(f"--diagnose: the run in {out} used {run['model']}, not {args.model}")
    records = read_jsonl(out / "predictions.jsonl")
    if not records:
        raise ConfigError(f"--diagnose: {out / 'predictions.jsonl'} holds no predictions yet")
    references = getattr(args, "references", None)
    own_count = len(records)
    if references:
        records = list(records) + reference_records(run, records, Path(references))
    config = IceCacheConfig(**run["config"])
    if getattr(args, "threads", None) is not None:  # index-work threads of the replays' caches: not a result
        config = config.replace(threads=args.threads)
    model, tokenizer = load_model(run["model"])
    chat = run["chat_template"] if run["chat_template"] is not None else bool(getattr(tokenizer, "chat_template", None))
    diag_path = out / "diagnosis.jsonl"
    stored = {row_key(r): r for r in read_jsonl(diag_path)}  # the last row of a sample wins

    def append(row: dict[str, Any]) -> None:
        with open(diag_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    fresh = diagnose_targets(model, tokenizer, records, targets, seed=run["seed"], config=config,
                             chat_template=chat, progress=not args.json, previous=stored, on_row=append)
    stored = {k: r for k, r in stored.items() if tuple(k[3:]) not in fresh}  # the targets' rows are `fresh`
    for target_rows in fresh.values():
        stored.update((row_key(r), r) for r in target_rows)
    rows = list(stored.values())
    tmp_rows = out / "diagnosis.jsonl.tmp"
    tmp_rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp_rows, diag_path)
    table = diagnosis_markdown(records, rows, targets)
    tmp = out / "diagnosis.md.tmp"
    command = f"icecache eval ruler --out {out} --diagnose '{args.diagnose}'" + (f" --references {references}" if references else "")
    tmp.write_text(f"Loss classes of `{out}` ({own_count} predictions{f', {len(records) - own_count} full and exact rows from {references}' if references else ''}; `{command}`).\n"
                   "A lost sample that full attention or the exact oracle has not run yet is not classified.\n\n" + table)
    os.replace(tmp, out / "diagnosis.md")
    print(table)
    return 0
