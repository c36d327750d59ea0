"""Run a task over methods x budgets x lengths x samples; summarise with sample counts and 95% intervals.

Each sample is prefilled once (`run_prefill`) and decoded under every method and budget from that one
prefill. Rows hold one (sample, method, budget) result each; `summarize` groups them.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icecache.core.config import IceCacheConfig
from icecache.eval.harness import Prefill, check_fits_context, clone_kv, decode_forced, decode_greedy, run_prefill
from icecache.eval.methods import get_method
from icecache.eval.passkey import make_passkey, passkey_correct
from icecache.eval.tasks import make_longgen, make_needle, make_ppl, needle_score
from icecache.runtime.cache import IceCache

TASKS = ("passkey", "needle", "ppl", "longgen")


@dataclass
class EvalSpec:
    """What to run. ``lengths`` are prompt lengths in tokens; ``samples`` per (length, variant)."""

    task: str
    methods: list[str]
    budgets: list[int]
    lengths: list[int]
    samples: int = 5
    seed: int = 0
    config: IceCacheConfig = field(default_factory=lambda: IceCacheConfig())
    depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])  # passkey
    variants: list[str] = field(default_factory=lambda: ["single", "multikey", "multivalue"])  # needle
    decode_tokens: int = 256  # ppl: teacher-forced tokens; longgen: generated tokens

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for m in self.methods:
            get_method(m).check(self.config)  # raises on unknown names and bad variant settings
        if not self.methods or not self.lengths:
            raise ValueError("methods and lengths must not be empty")
        if any(b < 0 for b in self.budgets) or any(n < 1 for n in self.lengths) or self.samples < 1:
            raise ValueError("budgets must be >= 0, lengths and samples >= 1")
        if self.task == "longgen" and "full" not in self.methods:
            self.methods = ["full", *self.methods]  # the reference every other method is compared with
        self.methods = sorted(self.methods, key=lambda m: m != "full")


def parse_length(s: str) -> int:
    """``"4k"`` -> 4000, ``"8192"`` -> 8192 (decimal k: `icecache.core.spec.parse_tokens`; RULER's lengths are binary)."""
    from icecache.core.spec import parse_tokens

    return parse_tokens(s)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap(values: list[float], stat: Callable[[np.ndarray], float] = np.mean, seed: int = 0, reps: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of ``stat`` over samples."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    boots = np.array([stat(x[rng.integers(0, len(x), len(x))]) for _ in range(reps)])
    return (float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5)))


def _samples(spec: EvalSpec, tokenizer: Any):
    """Yield ``(length, variant, sample_index, payload)``."""
    for n in spec.lengths:
        if spec.task == "passkey":
            for i in range(spec.samples):
                depth = spec.depths[i % len(spec.depths)]
                yield n, "filler", i, make_passkey(tokenizer, n, depth, seed=spec.seed * 7919 + n + i)
        elif spec.task == "needle":
            for v in spec.variants:
                for i in range(spec.samples):
                    yield n, v, i, make_needle(tokenizer, n, v, seed=spec.seed * 7919 + n + i)
        elif spec.task == "ppl":
            for i in range(spec.samples):
                yield n, "text", i, make_ppl(tokenizer, n, spec.decode_tokens, seed=spec.seed * 7919 + n + i)
        else:
            for i in range(spec.samples):
                yield n, "text", i, make_longgen(tokenizer, n, seed=spec.seed * 7919 + n + i)


def _input_ids(spec: EvalSpec, tokenizer: Any, payload: Any) -> torch.Tensor:
    if spec.task in ("passkey", "needle"):
        return tokenizer(payload.prompt, return_tensors="pt")["input_ids"]
    return torch.tensor([payload.context])


def run_eval(model: Any, tokenizer: Any, spec: EvalSpec, progress: bool = True,
             rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run ``spec``; one row per (sample, method, budget), appended to ``rows`` (a new list when None) as each
    finishes, so a caller interrupted midway keeps the finished rows."""
    from tqdm.auto import tqdm

    check_fits_context(model, spec.lengths)
    samples = list(_samples(spec, tokenizer))
    runs_per_sample = sum(len(spec.budgets) if get_method(m).uses_budget else 1 for m in spec.methods)
    bar = tqdm(total=len(samples) * runs_per_sample, desc=f"eval {spec.task}", unit="run", disable=not progress)
    rows = [] if rows is None else rows
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for length, variant, idx, payload in samples:
        ids = _input_ids(spec, tokenizer, payload)
        t0 = time.perf_counter()
        prefill = run_prefill(model, ids, obs_window=spec.config.window)
        prefill_s = time.perf_counter() - t0
        reference: list[int] | None = None
        for name in spec.methods:
            method = get_method(name)
            for budget in spec.budgets if method.uses_budget else [None]:
                cfg = spec.config.replace(budget=budget if budget is not None else spec.config.budget)
                t1 = time.perf_counter()
                cache = method.cache(model, prefill, cfg)
                try:
                    row = _score(spec, model, tokenizer, prefill, cache, payload, stop, reference)
                    if name == "full" and spec.task == "longgen":
                        reference = row.pop("_tokens")
                    row.pop("_tokens", None)
                    if isinstance(cache, IceCache):
                        st = cache.stats()
                        row["device_kv_bytes"] = st["device_kv_bytes"]
                        row["full_kv_bytes"] = st["full_kv_bytes"]
                        row["tokens_per_selection"] = st["tokens_per_selection"]
                        if cfg.index == "auto":  # which select auto chose for this prompt
                            row["auto_choice"] = st["index"]
                        if cfg.top_p is not None:
                            row["top_p"] = cfg.top_p
                finally:
                    if isinstance(cache, IceCache):
                        cache.close()
                row.update(task=spec.task, variant=variant, length=length, tokens=prefill.num_tokens, sample=idx,
                           method=name, budget=budget if budget is not None else "-", seconds=time.perf_counter() - t1,
                           prefill_seconds=prefill_s)
                rows.append(row)
                bar.update(1)
                bar.set_postfix_str(f"{name}@{budget} n={length}")
    bar.close()
    return rows


def _score(spec, model, tokenizer, prefill: Prefill, cache, payload, stop, reference) -> dict[str, Any]:
    if spec.task == "passkey":
        toks = decode_greedy(model, cache, prefill.last_logits, 8, stop)
        text = tokenizer.decode(toks, skip_special_tokens=True)
        return {"score": float(passkey_correct(payload, text)), "output": text.strip()[:40], "answer": payload.answer,
                "depth": payload.depth}
    if spec.task == "needle":
        toks = decode_greedy(model, cache, prefill.last_logits, payload.max_new_tokens, stop)
        text = tokenizer.decode(toks, skip_special_tokens=True)
        return {"score": needle_score(payload, text), "output": text.strip()[:60], "answer": " ".join(payload.values)}
    if spec.task == "ppl":
        nll = decode_forced(model, cache, prefill.last_logits, payload.targets)
        return {"score": float(torch.exp(nll.mean())), "mean_nll": float(nll.mean()), "decoded": len(payload.targets)}
    # longgen
    toks = decode_greedy(model, cache, prefill.last_logits, spec.decode_tokens, None)
    row: dict[str, Any] = {"_tokens": toks, "generated": len(toks)}
    if reference is not None:
        n = min(len(toks), len(reference))
        same = [a == b for a, b in zip(toks[:n], reference[:n])]
        first_diff = same.index(False) if False in same else n
        row["agreement"] = sum(same) / max(n, 1)
        row["prefix_match"] = first_diff
        nll = decode_forced(model, clone_kv(prefill.kv), prefill.last_logits, toks)  # the full model judges it
        row["full_model_ppl"] = float(torch.exp(nll.mean()))
        row["score"] = row["agreement"]
    else:
        row["score"] = 1.0
        nll = decode_forced(model, clone_kv(prefill.kv), prefill.last_logits, toks)
        row["full_model_ppl"] = float(torch.exp(nll.mean()))
        row["agreement"], row["prefix_match"] = 1.0, len(toks)
    return row


def summarize(rows: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Group rows by (task, variant, length, method, budget): n, mean score, 95% interval."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["variant"], r["length"], r["method"], str(r["budget"])), []).append(r)
    out = []
    for (task, variant, length, method, budget), rs in groups.items():
        s = [r["score"] for r in rs]
        entry: dict[str, Any] = {"task": task, "variant": variant, "length": length, "method": method, "budget": budget,
                                 "n": len(rs), "tokens": int(np.mean([r["tokens"] for r in rs]))}
        if task == "ppl":
            nll = [r["mean_nll"] for r in rs]
            entry["score"] = float(np.exp(np.mean(nll)))
            lo, hi = bootstrap(nll, seed=seed)
            entry["ci_low"], entry["ci_high"] = (math.exp(lo), math.exp(hi)) if not math.isnan(lo) else (math.nan, math.nan)
        elif task == "longgen":
            entry["score"] = float(np.mean(s))
            entry["ci_low"], entry["ci_high"] = bootstrap(s, seed=seed)
            entry["prefix_match"] = float(np.mean([r["prefix_match"] for r in rs]))
            entry["full_model_ppl"] = float(np.exp(np.mean(np.log([r["full_model_ppl"] for r in rs]))))
        else:
            entry["score"] = float(np.mean(s))
            if all(x in (0.0, 1.0) for x in s):
                entry["ci_low"], entry["ci_high"] = wilson(sum(s), len(s))
            else:
                entry["ci_low"], entry["ci_high"] = bootstrap(s, seed=seed)
        dk = [r.get("device_kv_bytes") for r in rs if r.get("device_kv_bytes")]
        if dk:
            entry["device_kv_fraction"] = float(np.mean([r["device_kv_bytes"] / r["full_kv_bytes"] for r in rs if r.get("device_kv_bytes")]))
        used = [r["tokens_per_selection"] for r in rs if r.get("tokens_per_selection") is not None]
        if used:
            entry["tokens_per_selection"] = float(np.mean(used))
        if rs[0].get("top_p") is not None:
            entry["top_p"] = rs[0]["top_p"]
        out.append(entry)
    return out


def markdown(summary: list[dict[str, Any]]) -> str:
    """One table per (task, variant): rows method@budget, columns prompt lengths; cells 'score [lo, hi] (n)'."""
    lines: list[str] = []
    keys = sorted({(e["task"], e["variant"]) for e in summary})
    for task, variant in keys:
        es = [e for e in summary if (e["task"], e["variant"]) == (task, variant)]
        lengths = sorted({e["length"] for e in es})
        label = {"passkey": "accuracy", "needle": "string match", "ppl": "perplexity (lower is better)",
                 "longgen": "token agreement with full attention"}[task]
        lines.append(f"\n**{task} / {variant}** -- {label}, 95% interval, (samples)\n")
        lines.append("| method | budget | " + " | ".join(f"{n} tok" for n in lengths) + " |")
        lines.append("|---|---|" + "---|" * len(lengths))
        rows = sorted({(e["method"], e["budget"]) for e in es}, key=lambda mb: (mb[0] != "full", mb[0], _num(mb[1])))
        for method, budget in rows:
            cells = []
            for n in lengths:
                e = next((x for x in es if x["method"] == method and x["budget"] == budget and x["length"] == n), None)
                cells.append("" if e is None else _cell(e))
            lines.append(f"| {method} | {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num(b: str) -> float:
    try:
        return float(b)
    except ValueError:
        return -1.0


def _cell(e: dict[str, Any]) -> str:
    fmt = "{:.2f}" if e["task"] == "ppl" else "{:.2f}"
    s = fmt.format(e["score"])
    if not math.isnan(e.get("ci_low", math.nan)):
        s += f" [{fmt.format(e['ci_low'])}, {fmt.format(e['ci_high'])}]"
    if e["task"] == "longgen" and e["method"] != "full":
        s += f" pm {e['prefix_match']:.0f}, ppl {e['full_model_ppl']:.2f}"
    elif e["task"] == "longgen":
        s += f" ppl {e['full_model_ppl']:.2f}"
    if e.get("top_p") is not None:  # adaptive budget: the middle tokens a selection attended on average
        s += f" top-p {e['top_p']:g}: {e['tokens_per_selection']:.0f} tok"
    return s + f" ({e['n']})"


def plot_summary(summary: list[dict[str, Any]], path: str | Path) -> None:
    """Score vs budget per method (one panel per task variant and prompt length); full attention as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(e["task"], e["variant"], e["length"]) for e in summary})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (task, variant, length) in zip(axes[0], panels):
        es = [e for e in summary if (e["task"], e["variant"], e["length"]) == (task, variant, length)]
        for method in sorted({e["method"] for e in es}):
            pts = sorted(((float(e["budget"]), e) for e in es if e["method"] == method and e["budget"] != "-"), key=lambda t: t[0])
            if pts:
                xs = [b for b, _ in pts]
                ys = [e["score"] for _, e in pts]
                lo = [e["score"] - e.get("ci_low", e["score"]) for _, e in pts]
                hi = [e.get("ci_high", e["score"]) - e["score"] for _, e in pts]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=method)
            full = next((e for e in es if e["method"] == method and e["budget"] == "-"), None)
            if full is not None:
                ax.axhline(full["score"], color="k", ls="--", lw=1, label=f"{method}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens)")
        ax.set_title(f"{task}/{variant}, {length} tok", fontsize=9)
        ax.set_ylabel({"ppl": "perplexity", "longgen": "token agreement"}.get(task, "score"))
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(rows: list[dict[str, Any]], summary: list[dict[str, Any]], out_dir: str | Path, header: str = "") -> None:
    """``rows.csv``, ``summary.csv``, ``results.json``, ``results.md`` and ``results.png`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("rows.csv", rows), ("summary.csv", summary)):
        cols = sorted({k for r in data for k in r})
        with open(out / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(data)
    (out / "results.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1, default=str))
    (out / "results.md").write_text(header + markdown(summary) + "\n![results](results.png)\n")
    plot_summary(summary, out / "results.png")
