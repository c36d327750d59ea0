"""Render the README's results (two tables and a figure) from the committed run files, so they cannot drift from
them (issues 22 and 55).

Writes two blocks of ``README.md``, each between marker comments, and nothing else there:

- ``results:table``: the "## Results" table, one short line per result (what / result), each with the run it
  comes from; the history behind each line lives in the experiment's own README, which the first cell links;
- ``results:longctx``: the table under "## Long context: Gemma-3-270M to 32k tokens";

and the figure ``experiments/results.png`` (RULER accuracy vs budget per model and length; Gemma-3-270M's decode
step and device KV vs context).

Every number is computed here from run files (CSV, JSON, JSONL; never a Markdown page): ratios and percentages
from the raw values, rounded only when printed. Reads (paths under ``experiments/``):

- ``eval/passkey_wide/summary.csv``, ``eval/passkey/summary.csv`` (passkey), ``eval/needle_wide/rows.csv``
  (needles), ``eval/ppl_wide/summary.csv``, ``eval/ppl_mass/summary.csv``, ``eval/ppl/summary.csv`` (perplexity);
- ``ruler/*/`` (``results.csv``, ``predictions.jsonl``, ``run.json``), with the rows ``ruler/targets.py`` names as
  the adopted settings (its ``CELLS``); a run counts as final when its ``results.csv`` accounts for every unit
  in its ``predictions.jsonl``, else it is shown as running, with its finished units;
- ``bench_index/wide_smollm2_8k/quality_summary.csv``, ``bench_index/quality_summary.csv``,
  ``bench_index/pareto.csv``, ``bench_index/scaling_capped/scaling_summary.csv``,
  ``bench_index/scaling_wide/scaling_summary.csv``;
- ``bench_runtime/interleaved_{8k,2k}_s22/``, ``interleaved_2k_s22b/`` and ``interleaved_gemma_32k_inline/``
  (``tpot_interleaved.json``);
- ``top_p/passkey_none/results.json``, ``top_p/passkey_p0.9/results.json``, ``top_p/ruler_niah_4k.json``;
- ``sim/validation.json``, ``sim/measured_runs.raw.jsonl``;
- ``reliability/soak_tiny_bg_interleaved{,2}/drift_vs_sim.json``, ``reliability/soak_model_mdci_merge/``
  (``soak.json``, ``drift_vs_sim_decode.json``), ``reliability/soak_tiny/soak.json``,
  ``reliability/soak_hnsw_trim/soak.json``;
- ``longctx/gemma_tpot_memory.csv``;
- ``serving/speed_2026-12-02/speed.json`` (the vLLM plugin against vLLM's dense CPU backend).

    python experiments/results.py           # rewrite README.md's blocks; redraw results.png if its data changed
    python experiments/results.py --check   # exit 1 with a one-line summary if README.md or results.png is stale

``--check`` compares README.md's blocks with what the files give (a RULER run that is still going, or absent,
counts as one state: its live unit count is not a claim) and the figure's *data*, not its pixels: the PNG carries
a SHA-256 of the values it plots (a text chunk of its metadata), and ``--check`` compares that digest with the
digest of the values the run files give now. So ``--check`` needs no matplotlib and does not depend on the bytes a
matplotlib version writes; only drawing the figure needs matplotlib.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import importlib.util
import json
import math
import re
import statistics
import struct
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
README = ROOT / "README.md"
FIGURE = EXP / "results.png"
MIB = 2**20
#: the longest line a generated block should hold (tests/test_results.py keeps the blocks under it)
MAX_LINE = 300
#: issue 8's TPOT drift target (as ``reliability/drift_vs_sim.py``'s ``summarise_repeats`` applies it)
DRIFT_TARGET = 0.10
#: the PNG text chunk that carries the digest of the figure's data
FIGURE_KEY = "Description"
FIGURE_TAG = "icecache-results-data sha256="


# ---------------------------------------------------------------- helpers


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_json(path: Path):
    return json.loads(path.read_text())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a line cut mid-write (a run still appending) is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def link(rel: str, full: bool = False) -> str:
    """A Markdown link to a repository path (relative to the README), shown as its last part (or whole)."""
    name = rel if full else rel.rstrip("/").rsplit("/", 1)[-1] + ("/" if rel.endswith("/") else "")
    return f"[`{name}`]({rel})"


def change(value: float, reference: float) -> float:
    """Relative change value / reference - 1, from raw values."""
    return value / reference - 1.0


def pct(fraction: float, digits: int = 1) -> str:
    """A signed percentage: 0.01292 -> '+1.29%' (digits=2)."""
    return f"{100 * fraction:+.{digits}f}%"


def times(x: float) -> str:
    return f"{x:.2f}x"


def klabel(tokens: float, k: int = 1000) -> str:
    """4000 -> '4k', 4138 -> '4k', 4096 with k=1024 -> '4k'."""
    return f"{round(tokens / k)}k"


def ppl_score(summary: Path, method: str, budget: str) -> float:
    for r in read_csv(summary):
        if r["method"] == method and r["budget"] == budget:
            return float(r["score"])
    raise KeyError(f"{summary}: no row {method}@{budget}")


def ppl_gap(summary: Path, method: str = "icecache", budget: str = "256") -> float:
    """Perplexity of method@budget relative to full attention in one ``summary.csv``: 7.3289 / 7.2354 - 1."""
    return change(ppl_score(summary, method, budget), ppl_score(summary, "full", "-"))


def slope(ns: list[float], ts: list[float]) -> float:
    """Least-squares exponent a of t ~ n^a (as the benchmark computes it)."""
    xs, ys = [math.log(n) for n in ns], [math.log(t) for t in ts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def kb(nbytes: float) -> str:
    v = nbytes / 1000
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _samples(n: int, per: str = "") -> str:
    """``"1 sample"``, ``"10 samples"``, ``"10 samples per task"``."""
    return f"{n} sample" + ("" if n == 1 else "s") + (f" per {per}" if per else "")


def spread(values: list[float], fmt=lambda v: f"{v:.2f}") -> str:
    """``"0.60"`` when all equal, else ``"0.20-0.80"``."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


# ---------------------------------------------------------------- accuracy (issue 5)

EVAL = "[accuracy](experiments/eval/SUMMARY.md)"


def rows_accuracy() -> list[tuple[str, str]]:
    ev = EXP / "eval"
    wide = read_csv(ev / "passkey_wide" / "summary.csv")
    pub = read_csv(ev / "passkey" / "summary.csv")
    lengths = sorted({int(r["length"]) for r in wide})

    def cell(rows, method, budget, length):
        return next(r for r in rows if r["method"] == method and r["budget"] == budget and int(r["length"]) == length)

    def scores(rows, method, budget):
        return " / ".join(f"{float(cell(rows, method, budget, n)['score']):.2f}" for n in lengths)

    def n_of(rows, method, budget):
        return _samples(min(int(cell(rows, method, budget, n)["n"]) for n in lengths), "length")

    equal = [cell(wide, "icecache", "64", n)["score"] == cell(wide, "full", "-", n)["score"] for n in lengths]
    eq = "=" if all(equal) else "= at " + ", ".join(klabel(n) for n, e in zip(lengths, equal) if e) + " only;"
    passkey = (f"IceCache@64 {eq} full attention at {' / '.join(klabel(n) for n in lengths)} ({scores(wide, 'full', '-')}, "
               f"{n_of(wide, 'icecache', '64')}; {link('experiments/eval/passkey_wide/')}); Quest@256 "
               f"{scores(pub, 'quest', '256')} ({n_of(pub, 'quest', '256')}; {link('experiments/eval/passkey/')})")

    rows = [r for r in read_csv(ev / "needle_wide" / "rows.csv") if r["variant"] in ("single", "multikey")]
    full = {(r["length"], r["variant"], r["sample"]): float(r["score"]) for r in rows if r["method"] == "full"}
    budgets = sorted({r["budget"] for r in rows if r["method"] == "icecache"}, key=int)
    mine = {b: {(r["length"], r["variant"], r["sample"]): float(r["score"]) for r in rows
                if r["method"] == "icecache" and r["budget"] == b} for b in budgets}
    if all(mine[b] == full for b in budgets):
        ice = f"IceCache@{' and @'.join(budgets)} = full, prompt for prompt"
    else:
        ice = "IceCache " + ", ".join(f"@{b} {sum(mine[b].values()):.0f} of {len(mine[b])}" for b in budgets)
    cells = {(length, variant) for length, variant, _ in full}
    per_cell = min(sum(1 for k in full if k[:2] == c) for c in cells)
    needle_lengths = " and ".join(klabel(int(n)) for n in sorted({int(n) for n, _ in cells}))
    needles = (f"single + multikey at {needle_lengths} ({_samples(per_cell, 'task and length')}): full attention "
               f"{sum(full.values()):.0f} of {len(full)}, {ice} ({link('experiments/eval/needle_wide/')})")

    w, m, p = ev / "ppl_wide" / "summary.csv", ev / "ppl_mass" / "summary.csv", ev / "ppl" / "summary.csv"
    texts = next(r for r in read_csv(w) if r["method"] == "full")
    ppl = (f"IceCache@256 vs full attention {pct(ppl_gap(w), 2)} (@64 {pct(ppl_gap(w, budget='64'), 2)}; "
           f"{_samples(int(texts['n']))} of {klabel(int(texts['tokens']))} tokens; {link('experiments/eval/ppl_wide/')}), "
           f"{pct(ppl_gap(m), 2)} with `page_score=mass`; Quest@256 {pct(ppl_gap(p, 'quest'))}, StreamingLLM "
           f"{pct(ppl_gap(p, 'streaming'))} ({link('experiments/eval/ppl/')})")
    return [(f"{EVAL}: passkey", passkey), (f"{EVAL}: needles", needles), (f"{EVAL}: perplexity", ppl)]


# ---------------------------------------------------------------- RULER (issue 23)

RULER = "[RULER](experiments/ruler/README.md)"
MODEL_NAMES = {"smollm2-135m-instruct": "SmolLM2-135M", "gemma-3-270m": "Gemma-3-270M"}


@cache
def targets_module():
    """``experiments/ruler/targets.py``: its ``CELLS`` name the rows of the adopted settings per model and length."""
    spec = importlib.util.spec_from_file_location("ruler_targets", EXP / "ruler" / "targets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def ruler_cells() -> list:
    return targets_module().CELLS


def ruler_units(d: Path) -> int:
    """Finished units in a run's ``predictions.jsonl`` (a unit: task, length, sample, method, budget)."""
    path = d / "predictions.jsonl"
    if not path.exists():
        return 0
    keys = set()
    for r in read_jsonl(path):
        try:
            keys.add(tuple(str(r[k]) for k in ("task", "length", "index", "method", "budget")))
        except KeyError:
            continue
    return len(keys)


def ruler_final(d: Path) -> bool:
    """A run's ``results.csv`` accounts for every unit of its ``predictions.jsonl`` (its per-task rows' samples)."""
    if not (d / "results.csv").exists():
        return False
    counted = sum(int(r["samples"]) for r in read_csv(d / "results.csv") if r["task"] != "average")
    return counted > 0 and counted == ruler_units(d)


def ruler_rows(d: Path, length: int | None = None) -> list[dict[str, str]]:
    """A run's ``results.csv`` rows, at one length (tokens) if given."""
    return [r for r in read_csv(d / "results.csv") if length is None or int(r["length"]) == length]


def ruler_tasks(rows: list[dict[str, str]]) -> str:
    """The task set of some rows: ``"11 tasks"``, ``"8 NIAH tasks"``."""
    tasks = {r["task"] for r in rows if r["task"] != "average"}
    kind = "NIAH task" if tasks and all(t.startswith("niah") for t in tasks) else "task"
    return f"{len(tasks)} {kind}" + ("" if len(tasks) == 1 else "s")


def ruler_model(d: Path) -> str:
    model = read_json(d / "run.json").get("model", d.name) if (d / "run.json").exists() else d.name
    return MODEL_NAMES.get(model, model)


def _ruler_order(d: Path) -> tuple[str, int, str]:
    """Runs by model, then context length (``gemma_4k`` before ``gemma_16k``), then name."""
    m = re.match(r"(.*?)_(\d+)k(.*)$", d.name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else (d.name, 0, "")


def ruler_runs() -> list[Path]:
    """The main RULER runs: folders with full attention's rows. Left out: ``shared_prefill_*`` (they time the
    shared prefill), ``*_check`` (a cross-check of one baseline), and runs without full attention (ablations of one
    method, companions of a main run)."""
    base = EXP / "ruler"
    if not base.is_dir():
        return []
    runs = [d for d in base.iterdir() if d.is_dir() and (d / "predictions.jsonl").exists()
            and not d.name.startswith("shared_prefill") and not d.name.endswith("_check")
            and any(r.get("method") == "full" for r in read_jsonl(d / "predictions.jsonl"))]
    return sorted(runs, key=_ruler_order)


def _average(d: Path, method: str, budget: str, length: int) -> tuple[float, int] | None:
    """(score, samples per task) of one ``average`` row, or None."""
    for r in ruler_rows(d, length):
        if r["task"] == "average" and r["method"] == method and r["budget"] == budget:
            return float(r["score"]), int(r["samples"])
    return None


def _ruler_cell_text(cell) -> tuple[str, str]:
    """One model at one length, as ``"4k 24.3 / 26.4 / 12.3"`` and its task set and samples (``"11 tasks, 25
    samples per task"``); ``"4k running (N finished units)"`` while a folder it reads is not final."""
    base = EXP / "ruler"
    folders = list(dict.fromkeys(row.folder for row in cell.rows.values()))
    if not any((base / f / "predictions.jsonl").exists() for f in folders):
        return f"{cell.length} not run yet", ""
    pending = [f for f in folders if not ruler_final(base / f)]
    if pending:
        units = sum(ruler_units(base / f) for f in pending)
        return f"{cell.length} running ({units} finished units in {', '.join(link(f'experiments/ruler/{f}/') for f in pending)})", ""
    main = base / cell.rows["full"].folder
    length = next(int(r["length"]) for r in ruler_rows(main) if klabel(int(r["length"]), 1024) == cell.length)
    got = [_average(base / cell.rows[role].folder, cell.rows[role].method, cell.rows[role].budget, length)
           for role in ("full", "icecache@256", "quest@256")]
    if None in got:
        return f"{cell.length} (a row is missing)", ""
    n = min(s for _, s in got)
    return (f"{cell.length} " + " / ".join(f"{score:.1f}" for score, _ in got),
            f"{ruler_tasks(ruler_rows(main, length))}, {_samples(n, 'task')}")


def rows_ruler() -> list[tuple[str, str]]:
    """One row per model and task set: RULER's average x100 of full attention, IceCache@256 and Quest@256 at the
    adopted settings (``targets.py``'s rows) per length, with the task set and the samples; SmolLM2's row adds
    kvpress's presses."""
    if not ruler_runs():
        return [(RULER, "not run yet")]
    out = []
    for model in dict.fromkeys(c.model for c in ruler_cells()):
        groups: dict[str, list[str]] = {}
        for c in ruler_cells():
            if c.model == model:
                text, tasks = _ruler_cell_text(c)
                groups.setdefault(tasks, []).append(text)
        for tasks, texts in groups.items():
            text = "full / IceCache@256 / Quest@256, average x100 (adopted settings): " + ", ".join(texts)
            for d in (d for d in ruler_runs() if ruler_model(d) == model and ruler_final(d)):
                presses = [r for r in ruler_rows(d) if r["task"] == "average" and r["method"].startswith("kvpress:")]
                if presses:
                    at = max(presses, key=lambda r: int(r["budget"]))["budget"]
                    scores = [float(r["score"]) for r in presses if r["budget"] == at]
                    text += f"; kvpress's {len(scores)} presses@{at} {spread(scores, lambda v: f'{v:.1f}')}"
            out.append((f"{RULER}, {model}", text + f" ({tasks + '; ' if tasks else ''}{link('experiments/ruler/targets.md')})"))
    return out


# ---------------------------------------------------------------- pagers (issues 3, 5)

INDEX = "[pagers](experiments/bench_index/README.md)"


def rows_index() -> list[tuple[str, str]]:
    bi = EXP / "bench_index"

    def recall(path: Path, method: str) -> float:
        return next(float(r["attention_recall"]) for r in read_csv(path) if r["method"] == method and r["budget"] == "128")

    wide = bi / "wide_smollm2_8k" / "quality_summary.csv"
    quality = (f"attention recall @128, SmolLM2 8k: M-DCI {recall(wide, 'mdci'):.3f} (published search "
               f"{recall(wide, 'mdci[icecache]'):.3f}), Quest {recall(wide, 'sequential'):.3f} "
               f"({link('experiments/bench_index/wide_smollm2_8k/')}), k-means pages "
               f"{recall(bi / 'quality_summary.csv', 'kmeans'):.3f} ({link('experiments/bench_index/quality_summary.csv')})")

    cap = [r for r in read_csv(bi / "scaling_capped" / "scaling_summary.csv") if r["data"] == "real"]
    at = next(r for r in cap if int(r["n"]) == 131072)
    speed = float(at["exact_select_ms@128"]) / float(at["mdci_select_ms@128"])
    rel = float(at["mdci_recall@128"]) / float(at["exact_recall@128"])
    a = slope([float(r["n"]) for r in cap], [float(r["mdci_select_ms@128"]) for r in cap])
    sw = next(r for r in read_csv(bi / "scaling_wide" / "scaling_summary.csv") if r["data"] == "real" and int(r["n"]) == 131072)
    ex = float(sw["exact_recall@128"])
    scale = (f"M-DCI selects {times(speed)} faster than exact (time ~ n^{a:.2f}) with {rel:.2f} of its recall "
             f"({link('experiments/bench_index/scaling_capped/')}); with pages of 1 instead of 16: "
             f"{float(sw['mdci[P1]_recall@128']) / ex:.2f} ({link('experiments/bench_index/scaling_wide/')})")

    pareto = read_csv(bi / "pareto.csv")
    front = [r["method"] for r in pareto if r["pareto_optimal"] == "True"]
    families = sorted({r["family"] for r in pareto} - {r["family"] for r in pareto if r["pareto_optimal"] == "True"})
    backends = (f"Pareto front of recall @128 vs select time (8k, every knob swept): {', '.join(front)}; "
                f"dominated: {', '.join(families)} ({link('experiments/bench_index/pareto.csv')})")
    return [(f"{INDEX}: recall", quality), (f"{INDEX}: {klabel(int(at['n']), 1024)} keys", scale),
            (f"{INDEX}: backends", backends)]


# ---------------------------------------------------------------- decode speed and memory (issues 4, 24)

DECODE = "[decode](experiments/bench_runtime/README.md)"
#: the latest interleaved runs of the acceptance cells (bench_runtime question 4, 2026-12-06)
DECODE_8K, DECODE_2K = "interleaved_8k_s22", ("interleaved_2k_s22", "interleaved_2k_s22b")
DECODE_GEMMA = "interleaved_gemma_32k_inline"
#: the page of bench_runtime's question 4 (the decode step against its floor, the exact scorer, `index="auto"`)
DECODE_PAGE = "q4_floor_and_auto.md"


def _variants(run: str) -> dict:
    return read_json(EXP / "bench_runtime" / run / "tpot_interleaved.json")["variants"]


def auto_gap(variants: dict) -> float:
    """``index="auto"``'s step over the faster of exact's and M-DCI's, minus 1 (medians of the run)."""
    best = min(variants["exact@256"]["median_step_ms"], variants["mdci@256"]["median_step_ms"])
    return change(variants["auto@256"]["median_step_ms"], best)


def rows_decode() -> list[tuple[str, str]]:
    br = "experiments/bench_runtime"
    v = _variants(DECODE_8K)
    ice, quest = v["mdci@256"], v["sequential@256"]
    floor = next(name for name in v if name.startswith("floor@"))
    speed = (f"SmolLM2 8k: IceCache@256's step {times(ice['ratio_vs_full_median'])} full attention's, "
             f"**{times(ice['ratio_vs_floor_median'])}** its floor (full attention on {floor.split('@')[1]} tokens); "
             f"Quest@256's {times(quest['ratio_vs_full_median'])}, **{times(quest['ratio_vs_floor_median'])}** "
             f"(targets 1.2x, <= Quest: missed; {link(f'{br}/{DECODE_8K}/')})")
    c = ice["copies_per_layer_step"]
    memory = (f"SmolLM2 8k, budget 256: device KV {100 * ice['device_kv_fraction']:.1f}% of full attention's, "
              f"{'one copy' if c == 1 else f'{c:.2f} copies'} per layer step ({link(f'{br}/{DECODE_8K}/')})")
    gemma = _variants(DECODE_GEMMA)
    auto = (f"step vs the faster of exact and M-DCI (target within 5%): SmolLM2 2k "
            f"{' and '.join(pct(auto_gap(_variants(r))) for r in DECODE_2K)} ({len(DECODE_2K)} runs), 8k "
            f"{pct(auto_gap(v))}, Gemma-3 32k {pct(auto_gap(gemma))} (the runs: [question 4]({br}/{DECODE_PAGE}))")
    long = (f"Gemma-3-270M 32k, budget 256: IceCache (auto) **{times(gemma['auto@256']['ratio_vs_floor_median'])}** "
            f"the full-attention step at {klabel(int(next(n for n in gemma if n.startswith('floor@')).split('@')[1]))} "
            f"(target 1.1x; {link(f'{br}/{DECODE_GEMMA}/')})")
    return [(f"{DECODE}: speed", speed), (f"{DECODE}: memory", memory), (f"{DECODE}: `index=\"auto\"`", auto),
            (f"{DECODE}: long context", long)]


# ---------------------------------------------------------------- adaptive budget (issue 24)


def rows_top_p() -> list[tuple[str, str]]:
    """Passkey and RULER NIAH scores with and without top-p, and the middle tokens attended per selection."""
    d = EXP / "top_p"

    def passkey(run: str) -> dict[tuple[int, int], list[dict]]:
        out: dict[tuple[int, int], list[dict]] = {}
        for r in read_json(d / run / "results.json")["rows"]:
            out.setdefault((r["length"], r["budget"]), []).append(r)
        return out

    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    fixed, cut = passkey("passkey_none"), passkey("passkey_p0.9")
    same = all(mean(fixed[k], "score") == mean(cut[k], "score") for k in fixed)
    n = min(len(rs) for rs in fixed.values())
    budgets = sorted({b for _, b in fixed})
    tokens = "; ".join(f"@{b} {spread([mean(fixed[k], 'tokens_per_selection') for k in fixed if k[1] == b], lambda t: f'{t:.0f}')} -> "
                       f"{spread([mean(cut[k], 'tokens_per_selection') for k in cut if k[1] == b], lambda t: f'{t:.0f}')}"
                       for b in budgets)
    ruler = read_json(d / "ruler_niah_4k.json")
    p9 = next(t for t in ruler["top_p"] if t["p"] == 0.9)
    text = (f"passkey {'/'.join(sorted({klabel(n) for n, _ in fixed}, key=lambda s: int(s[:-1])))} ({_samples(n, 'cell')}): "
            f"top-p 0.9 {'keeps every score' if same else 'changes scores'}, middle tokens {tokens} "
            f"({link('experiments/top_p/passkey_p0.9/')}); RULER NIAH 4k, {ruler['row']} ({_samples(ruler['samples'])}): "
            f"{ruler['fixed']:.3f} -> {p9['score']:.3f} (full {ruler['full']:.3f})")
    return [("[adaptive budget](experiments/top_p/README.md)", text)]


# ---------------------------------------------------------------- simulator


SIM = "[simulator](experiments/sim/README.md)"


def rows_sim() -> list[tuple[str, str]]:
    """The validation on measured runs (``validation.json``). The paper's A100 breakdown and the H100 crossover are
    written as Markdown / text only (``icecache sim paper`` / ``crossover`` have no JSON output): linked, not
    quoted."""
    sim = EXP / "sim"
    v = read_json(sim / "validation.json")
    runs = read_jsonl(sim / "measured_runs.raw.jsonl")
    configs = {(r["variant"], r["context"], r["budget"], r["page_size"], r["threads"], r["reuse_every"]) for r in runs}
    rounds = {r["round"] for r in runs}
    held = "/".join(klabel(c) for c in sorted({r["context"] for r in v["rows"]}))
    passes = v["passes_corrected"]
    tau_key = next(k for k in passes if k.startswith("Kendall"))
    text = (f"predicted vs measured, {len(configs)} configurations x {len(rounds)} rounds, {held} held out: TPOT "
            f"{100 * v['corrected']['tpot']['mape']:.1f}% MAPE, TT2T {100 * v['corrected']['tt2t']['mape']:.1f}%, Kendall "
            f"tau {v['tau_corrected']:.3f} (target {tau_key.rsplit('>= ', 1)[-1]}); {sum(passes.values())} of "
            f"{len(passes)} targets met ({link('experiments/sim/validation.json')})")
    paper = (f"the paper's A100 breakdown ({link('experiments/sim/paper_a100.md')}) and H100 crossover "
             f"({link('experiments/sim/crossover_h100_qwen3.txt')})")
    return [(f"{SIM}: validation", text), (f"{SIM}: the paper", paper)]


# ---------------------------------------------------------------- reliability (issue 8)

RELIABILITY = "[reliability](experiments/reliability/README.md)"


def rows_reliability() -> list[tuple[str, str]]:
    rel = EXP / "reliability"
    first = read_json(rel / "soak_tiny_bg_interleaved" / "drift_vs_sim.json")
    second = {r["pager"]: r for r in read_json(rel / "soak_tiny_bg_interleaved2" / "drift_vs_sim.json")}
    key = "drift_vs_reference_apart_from_sim_step_growth"
    whole = [r[key] for r in first]
    agree = max(abs(r[key] - second[r["pager"]][key]) for r in first if r["pager"] in second)

    def tokens(run: str) -> str:
        return "/".join(sorted({klabel(r["new_tokens"]) for r in read_json(rel / run / "soak.json")["runs"]}))

    drift = (f"tiny model, {tokens('soak_tiny_bg_interleaved')} tokens, every pager: TPOT drift beyond the "
             f"simulator's step growth {pct(min(whole))} to {pct(max(whole))}, {sum(w <= DRIFT_TARGET for w in whole)} of "
             f"{len(whole)} within {pct(DRIFT_TARGET, 0)}; a repeat agrees within {100 * agree:.1f} points "
             f"({link('experiments/reliability/soak_tiny_bg_interleaved/')})")
    model = read_json(rel / "soak_model_mdci_merge" / "drift_vs_sim_decode.json")[0]
    soak = (f"SmolLM2, {tokens('soak_model_mdci_merge')} tokens: TPOT {model['tpot_warm_ms']:.1f} -> "
            f"{model['tpot_end_ms']:.1f} ms, **{pct(model['drift_apart_from_sim_growth_and_dense'])}** beyond the "
            f"simulator's index and dense-layer growth ({link('experiments/reliability/soak_model_mdci_merge/')})")
    before = next(r for r in read_json(rel / "soak_tiny" / "soak.json")["runs"] if r["index"] == "hnsw")
    trim = read_json(rel / "soak_hnsw_trim" / "soak.json")["runs"][0]
    rss = (f"RSS growth of a {tokens('soak_hnsw_trim')}-token hnsw soak: {kb(before['rss_slope_bytes_per_step'])} -> "
           f"{kb(trim['rss_slope_bytes_per_step'])} KB per step with `heap_policy=\"trim\"` (the default; "
           f"{link('experiments/reliability/soak_hnsw_trim/')})")
    return [(f"{RELIABILITY}: drift", drift), (f"{RELIABILITY}: soak", soak), (f"{RELIABILITY}: memory", rss)]


# ---------------------------------------------------------------- serving

SERVING_RUN = "serving/speed_2026-12-02"


def rows_serving() -> list[tuple[str, str]]:
    """The vLLM plugin's decode step over vLLM's dense CPU backend (same run), per batch, at each context."""
    res = read_json(EXP / SERVING_RUN / "speed.json")
    tpot = {(r["engine"], r["context"], r["batch"]): r["tpot_ms"] for r in res["rows"]}
    contexts = sorted({c for _, c, _ in tpot})
    engines = list(dict.fromkeys(e for e, _, _ in tpot if e != "dense"))
    cells = []
    for batch in sorted({b for _, _, b in tpot}):
        ratios = ", ".join(f"{e.split()[-1]} " + " / ".join(times(tpot[(e, c, batch)] / tpot[("dense", c, batch)]) for c in contexts)
                           for e in engines)
        cells.append(f"batch {batch}: {ratios}")
    text = (f"TPOT over vLLM's dense CPU backend at {' / '.join(klabel(c) for c in contexts)}, " + "; ".join(cells)
            + f" ({link(f'experiments/{SERVING_RUN}/')})")
    return [("[serving](docs/serving.md) (vLLM, CPU)", text)]


def results_table() -> str:
    rows = (rows_accuracy() + rows_ruler() + rows_index() + rows_decode() + rows_top_p() + rows_sim()
            + rows_reliability() + rows_serving())
    return "\n".join(["| what | result |", "|---|---|"] + [f"| {w} | {h} |" for w, h in rows])


# ---------------------------------------------------------------- the long-context table

LONGCTX = EXP / "longctx" / "gemma_tpot_memory.csv"


def longctx_table() -> str:
    rows = read_csv(LONGCTX)
    by = {(int(r["context"]), r["variant"]): r for r in rows}
    lines = ["| context | prefill | full TPOT | IceCache@256 TPOT | Quest@256 TPOT | global-layer KV on device: full | IceCache@256 |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in (8000, 16000, 32000):
        full, ice, quest = by[(n, "full")], by[(n, "mdci@256")], by[(n, "sequential@256")]
        ft = float(full["tpot_ms_median"])

        def tpot(r, ft=ft):
            t = float(r["tpot_ms_median"])
            return f"{t:.1f} ms ({times(t / ft)})"

        fk, ik = float(full["global_kv_bytes"]), float(ice["global_kv_bytes"])
        lines.append(f"| {klabel(n)} | {float(full['prefill_s']):.0f} s | {ft:.1f} ms | {tpot(ice)} | {tpot(quest)} | "
                     f"{fk / MIB:.1f} MiB | {ik / MIB:.2f} MiB ({100 * ik / fk:.1f}%) |")
    return "\n".join(lines)


# ---------------------------------------------------------------- the figure

#: RULER methods of a main run that the figure plots, with their labels
RULER_METHODS = {"icecache": "IceCache", "quest": "Quest", "exact": "exact top-B (oracle)", "pqcache": "PQCache",
                 "snapkv": "SnapKV", "streaming": "StreamingLLM"}
#: longctx variants of the TPOT panel and of the device-KV panel, with their labels
TPOT_VARIANTS = {"full": "full attention", "mdci@256": "IceCache@256", "sequential@256": "Quest@256"}
KV_VARIANTS = {"full": "full attention", "mdci@256": "IceCache@256", "sequential@256": "Quest@256",
               "mdci@64": "IceCache@64"}


def _series(d: Path, method: str, length: int) -> list[list[float]]:
    """[[budget, score], ...] of one method's ``average`` rows at one length, by budget."""
    rows = [r for r in ruler_rows(d, length) if r["task"] == "average" and r["method"] == method and r["budget"] != "-"]
    return sorted([int(r["budget"]), float(r["score"])] for r in rows)


def figure_data() -> dict:
    """Everything the figure plots, as plain values (its digest is what ``--check`` compares). RULER: one panel per
    final main run and length, with the main run's methods and, where ``targets.py`` reads IceCache or Quest from
    another folder, those rows too (only when that folder covers the same tasks and samples: a panel never mixes
    task sets). Right: Gemma-3-270M's TPOT and global-layer device KV vs context (``longctx/``)."""
    cells = {(c.model, c.length): c for c in ruler_cells()} if ruler_runs() else {}
    panels = []
    for d in ruler_runs():
        if not ruler_final(d):
            continue
        model = ruler_model(d)
        for length in sorted({int(r["length"]) for r in ruler_rows(d)}):
            rows = ruler_rows(d, length)
            full = next(r for r in rows if r["task"] == "average" and r["method"] == "full")
            tasks = {r["task"] for r in rows if r["task"] != "average"}
            series = {label: _series(d, method, length) for method, label in RULER_METHODS.items()}
            cell = cells.get((model, klabel(length, 1024)))
            for role, label in (("icecache@256", "IceCache, adopted settings"), ("quest@256", "Quest, adopted settings")):
                row = cell.rows[role] if cell else None
                other = EXP / "ruler" / row.folder if row else None
                if row is None or (row.folder, row.method) == (d.name, role.split("@")[0]) or not ruler_final(other):
                    continue
                theirs = ruler_rows(other, length)
                same = ({r["task"] for r in theirs if r["task"] != "average"} == tasks
                        and all(r["samples"] == full["samples"] for r in theirs if r["method"] == row.method))
                if same:
                    series[label] = _series(other, row.method, length)
            panels.append({"title": f"{model} {klabel(length, 1024)}",
                           "subtitle": f"{ruler_tasks(rows)}, {_samples(int(full['samples']), 'task')}",
                           "full": float(full["score"]), "series": {k: v for k, v in series.items() if v}})
    rows = read_csv(LONGCTX)

    def curves(variants: dict[str, str], column: str, scale: float = 1.0) -> dict[str, list[list[float]]]:
        """label -> [[context, value], ...]; variants with the same curve share one line ("IceCache@256, Quest@256")."""
        out: dict[str, list[list[float]]] = {}
        for v, label in variants.items():
            pts = sorted([int(r["context"]), float(r[column]) / scale] for r in rows if r["variant"] == v)
            same = next((k for k, have in out.items() if have == pts), None)
            if same:
                out[f"{same}, {label}"] = out.pop(same)
            else:
                out[label] = pts
        return out

    return {"ruler": panels, "tpot": curves(TPOT_VARIANTS, "tpot_ms_median"),
            "kv": curves(KV_VARIANTS, "global_kv_bytes", MIB)}


def figure_digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def png_text(path: Path) -> dict[str, str]:
    """The ``tEXt`` chunks of a PNG file (keyword -> text)."""
    out: dict[str, str] = {}
    blob = path.read_bytes() if path.exists() else b""
    if blob[:8] != b"\x89PNG\r\n\x1a\n":
        return out
    pos = 8
    while pos + 8 <= len(blob):
        (size,), kind = struct.unpack(">I", blob[pos:pos + 4]), blob[pos + 4:pos + 8]
        body = blob[pos + 8:pos + 8 + size]
        if kind == b"tEXt" and b"\0" in body:
            key, _, text = body.partition(b"\0")
            out[key.decode("latin-1")] = text.decode("latin-1")
        if kind == b"IEND":
            break
        pos += 12 + size
    return out


def figure_is_current(data: dict, path: Path = FIGURE) -> bool:
    return png_text(path).get(FIGURE_KEY) == FIGURE_TAG + figure_digest(data)


STYLE = {"IceCache": ("C0", "-", "o"), "IceCache, adopted settings": ("C0", "--", "s"), "Quest": ("C1", "-", "o"),
         "Quest, adopted settings": ("C1", "--", "s"), "exact top-B (oracle)": ("0.45", ":", "^"),
         "PQCache": ("C2", "-", "v"), "SnapKV": ("C3", "-", "x"), "StreamingLLM": ("C4", "-", "+"),
         "full attention": ("k", "-", "o"), "IceCache@256": ("C0", "-", "o"), "Quest@256": ("C1", "-", "o"),
         "IceCache@64": ("C0", ":", "s")}


def draw_figure(data: dict, path: Path = FIGURE) -> None:
    """Left: RULER average x100 vs budget, one panel per model and length (full attention as a horizontal line), a
    legend in the first free slot; right: TPOT and global-layer device KV vs context. The digest of ``data`` goes
    into the PNG's metadata."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    panels = data["ruler"]
    cols = 3
    grid_rows = max(2, math.ceil((len(panels) + 1) / cols))
    fig = plt.figure(figsize=(17, 4.2 * grid_rows))
    grid = fig.add_gridspec(grid_rows, cols + 1, width_ratios=[1] * cols + [1.25], hspace=0.45, wspace=0.3)
    labels: dict[str, None] = {}
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        ax.axhline(panel["full"], color="k", lw=1.5, label="full attention")
        budgets = sorted({b for pts in panel["series"].values() for b, _ in pts})
        for label, pts in panel["series"].items():
            color, ls, marker = STYLE.get(label, (None, "-", "o"))
            ax.plot([b for b, _ in pts], [s for _, s in pts], color=color, ls=ls, marker=marker, label=label)
            labels[label] = None
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"RULER, {panel['title']}\n{panel['subtitle']}", fontsize=10)
        ax.set_xlabel("budget (middle tokens per layer and KV head)", fontsize=9)
        ax.set_ylabel("RULER average x100", fontsize=9)
        ax.grid(alpha=0.3)
    legend_ax = fig.add_subplot(grid[len(panels) // cols, len(panels) % cols])
    legend_ax.axis("off")
    handles = [Line2D([], [], color="k", lw=1.5, label="full attention")]
    for label in labels:
        color, ls, marker = STYLE.get(label, (None, "-", "o"))
        handles.append(Line2D([], [], color=color, ls=ls, marker=marker, label=label))
    legend_ax.legend(handles=handles, loc="center", fontsize=9, frameon=False,
                     title="RULER panels (experiments/ruler/);\nadopted settings: the rows targets.md reads")

    right = grid[:, cols].subgridspec(2, 1, hspace=0.35)
    for k, (key, ylabel, title) in enumerate((
            ("tpot", "TPOT, median (ms)", "Gemma-3-270M: decode step vs context"),
            ("kv", "global-layer KV on the device (MiB)", "Gemma-3-270M: device KV vs context"))):
        ax = fig.add_subplot(right[k])
        contexts = sorted({c for pts in data[key].values() for c, _ in pts})
        for label, pts in data[key].items():
            color, ls, marker = STYLE.get(label.split(",")[0], (None, "-", "o"))
            ax.plot([c for c, _ in pts], [v for _, v in pts], color=color, ls=ls, marker=marker, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [klabel(c) for c in contexts])
        ax.minorticks_off()
        if key == "kv":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(f"{title}\n(experiments/longctx/, pages of 16)", fontsize=10)
        ax.set_xlabel("context (tokens)", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("IceCache on a 2-core CPU: RULER accuracy vs budget (left), decode step and device KV vs context "
                 "(right); drawn by experiments/results.py", fontsize=11)
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={FIGURE_KEY: FIGURE_TAG + figure_digest(data)})
    plt.close(fig)


# ---------------------------------------------------------------- README blocks


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- results:{name} begin (generated by experiments/results.py; do not edit) -->", f"<!-- results:{name} end -->")


def render() -> dict[str, str]:
    return {"table": results_table(), "longctx": longctx_table()}


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        begin, end = markers(name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md: markers for block {name!r} not found")
        text = pattern.sub(lambda _m, b=begin, body=body, e=end: f"{b}\n{body}\n{e}", text, count=1)
    return text


def _pending(line: str) -> str:
    """A RULER row with its live parts as one state: a running run's unit count is not a claim, and a row with no
    final results (running or absent) compares equal to any other such row."""
    if not line.startswith(f"| {RULER}"):
        return line
    if "per task" not in line:
        return line.split(" | ")[0] + " | (no final results) |"
    return re.sub(r"running \(\d+ finished units", "running (... finished units", line)


def check(text: str, blocks: dict[str, str]) -> list[str]:
    diffs = []
    for name, body in blocks.items():
        begin, end = markers(name)
        m = re.search(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), text, re.S)
        if not m:
            diffs.append(f"{name}: markers missing")
            continue
        have = [_pending(x) for x in m.group(1).splitlines()]
        want = [_pending(x) for x in body.splitlines()]
        changed = sum(a != b for a, b in zip(have, want)) + abs(len(have) - len(want))
        if changed:
            diffs.append(f"{name}: {changed} line(s) differ")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's blocks or results.png are out of date")
    ap.add_argument("--redraw", action="store_true", help="redraw results.png even when its data did not change")
    args = ap.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    blocks = render()
    data = figure_data()
    if args.check:
        diffs = check(text, blocks)
        if not figure_is_current(data):
            diffs.append(f"{FIGURE.relative_to(ROOT)}: drawn from other data")
        if diffs:
            print("out of date (run `make results`): " + "; ".join(diffs))
            return 1
        return 0
    new = replace_blocks(text, blocks)
    if new != text:
        README.write_text(new, encoding="utf-8")
    if args.redraw or not figure_is_current(data):
        draw_figure(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
