"""Render the README's result tables from the committed run files, so they cannot drift from them (issue 22).

Writes two blocks of ``README.md``, each between marker comments, and nothing else:

- ``results:table``: the "## Results" table (what / where / headline);
- ``results:longctx``: the table under "## Long context: Gemma-3-270M to 32k tokens".

Every number in those blocks is computed here from the files below; ratios and percentages from the raw
values, rounded only when printed. Reads (paths under ``experiments/``):

- ``eval/passkey_wide/summary.csv``, ``eval/passkey/summary.csv`` (passkey), ``eval/needle_wide/rows.csv``
  (needles), ``eval/ppl_wide/summary.csv``, ``eval/ppl_mass/summary.csv``, ``eval/ppl/summary.csv`` (perplexity);
- ``ruler/*/`` (``results.csv``, ``results.md``, ``predictions.jsonl``, ``run.json``) when such folders exist;
  a run without final results is shown as running, with its finished units;
- ``bench_index/wide_smollm2_8k/quality_summary.csv``, ``bench_index/quality_summary.csv``,
  ``bench_index/scaling_capped/scaling_summary.csv``, ``bench_index/scaling_wide/scaling_summary.csv``;
- ``bench_runtime/interleaved_8k_merge/tpot_interleaved.json`` (latest), ``.../interleaved_8k_before/...``,
  ``bench_runtime/select_cost*/select_cost.json``;
- ``sim/paper_a100.md``, ``sim/validation.json``, ``sim/measured_runs.raw.jsonl``, ``sim/crossover_h100_qwen3.txt``;
- ``reliability/soak_tiny_bg_interleaved{,2}/`` and ``reliability/soak_model_mdci_merge/`` (``soak.json``;
  ``drift_vs_sim.json``, resp. ``drift_vs_sim_decode.json``), ``reliability/drift_bg_repeats.{json,md}`` (the
  plain soaks' spread, the +10% target), ``reliability/soak_tiny/soak.json``,
  ``reliability/soak_hnsw_{trim,pinned}/soak.json``, ``reliability.md`` (the pin's build times);
- ``longctx/gemma_tpot_memory.csv``;
- ``serving/speed_2026-12-02/speed.json`` (the vLLM plugin against vLLM's dense CPU backend and the HF runtime).

    python experiments/results.py           # rewrite README.md's blocks in place (make results)
    python experiments/results.py --check   # exit 1 with a one-line summary if README.md's blocks differ

``--check`` treats a RULER run that is still going (or absent) as one state: its live unit count is not a claim.
Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
README = ROOT / "README.md"
MIB = 2**20


# ---------------------------------------------------------------- helpers


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_json(path: Path):
    return json.loads(path.read_text())


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


# ---------------------------------------------------------------- rows of the Results table


def row_accuracy() -> tuple[str, str, str]:
    ev = EXP / "eval"
    wide = read_csv(ev / "passkey_wide" / "summary.csv")
    pub = read_csv(ev / "passkey" / "summary.csv")
    lengths = sorted({int(r["length"]) for r in wide})

    def score(rows, method, budget, length):
        return next(float(r["score"]) for r in rows if r["method"] == method and r["budget"] == budget and int(r["length"]) == length)

    equal = [score(wide, "icecache", "64", n) == score(wide, "full", "-", n) for n in lengths]
    eq_text = "= full" if all(equal) else "= full at " + ", ".join(klabel(n) for n, e in zip(lengths, equal) if e) + " only,"
    full_s = " / ".join(f"{score(wide, 'full', '-', n):.2f}" for n in lengths)
    n_pk = min(int(r["n"]) for r in wide)
    quest = " / ".join(f"{score(pub, 'quest', '256', n):.2f}" for n in lengths)
    passkey = (f"passkey ({link('experiments/eval/passkey_wide/')}, {n_pk} samples per length): IceCache@64 {eq_text} at "
               f"{' / '.join(klabel(n) for n in lengths)} (full {full_s}); Quest@256 {quest} ({link('experiments/eval/passkey/')})")

    rows = [r for r in read_csv(ev / "needle_wide" / "rows.csv") if r["variant"] in ("single", "multikey")]
    full = {(r["length"], r["variant"], r["sample"]): float(r["score"]) for r in rows if r["method"] == "full"}
    budgets = sorted({r["budget"] for r in rows if r["method"] == "icecache"}, key=int)
    mine = {b: {(r["length"], r["variant"], r["sample"]): float(r["score"]) for r in rows
                if r["method"] == "icecache" and r["budget"] == b} for b in budgets}
    if all(mine[b] == full for b in budgets):
        ice = f"IceCache@{' and @'.join(budgets)} = full, prompt for prompt"
    else:
        ice = "IceCache " + ", ".join(f"@{b} {sum(mine[b].values()):.0f} of {len(mine[b])}" for b in budgets)
    needles = (f"needles, single + multikey ({link('experiments/eval/needle_wide/')}): full {sum(full.values()):.0f} of "
               f"{len(full)}, {ice}")

    w, m, p = ev / "ppl_wide" / "summary.csv", ev / "ppl_mass" / "summary.csv", ev / "ppl" / "summary.csv"
    ppl = (f"perplexity @256 vs full: {pct(ppl_gap(w), 2)} with the default search ({link('experiments/eval/ppl_wide/')}; "
           f"@64 {pct(ppl_gap(w, budget='64'), 2)}), {pct(ppl_gap(m), 2)} with `page_score=mass` "
           f"({link('experiments/eval/ppl_mass/')}); Quest {pct(ppl_gap(p, 'quest'))}, StreamingLLM "
           f"{pct(ppl_gap(p, 'streaming'))} ({link('experiments/eval/ppl/')})")
    return ("accuracy vs baselines (issue 5)", link("experiments/eval/SUMMARY.md", full=True), "; ".join([passkey, needles, ppl]))


def _ruler_units(path: Path) -> int:
    keys = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                keys.add(tuple(str(r[k]) for k in ("task", "length", "index", "method", "budget")))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut mid-write
    return len(keys)


MODEL_NAMES = {"smollm2-135m-instruct": "SmolLM2", "gemma-3-270m": "Gemma-3-270M"}


def _ruler_averages(d: Path) -> str:
    """Per length: full, IceCache at each budget, Quest at its largest budget and the range of kvpress's presses
    there, from ``results.csv``."""
    model = read_json(d / "run.json").get("model", d.name) if (d / "run.json").exists() else d.name
    avg = [r for r in read_csv(d / "results.csv") if r["task"] == "average"]
    out = []
    for length in sorted({int(r["length"]) for r in avg}):
        rs = [r for r in avg if int(r["length"]) == length]

        def pick(method, budgets, rs=rs):
            return [r for r in rs if r["method"] == method and (budgets is None or r["budget"] in budgets)]

        quest_b = max((int(r["budget"]) for r in rs if r["method"] == "quest"), default=None)
        cells, last = [], None
        for r in pick("full", None) + pick("icecache", None) + pick("quest", {str(quest_b)}):
            label = r["method"] if r["budget"] == "-" else (f"@{r['budget']}" if r["method"] == last else f"{r['method']}@{r['budget']}")
            cells.append(f"{label} {float(r['score']):.1f}")
            last = r["method"]
        presses = [float(r["score"]) for r in rs if r["method"].startswith("kvpress:") and r["budget"] == str(quest_b)]
        if presses:
            cells.append(f"kvpress's {len(presses)} presses@{quest_b} {min(presses):.1f}-{max(presses):.1f}")
        n = min(int(r["samples"]) for r in rs)
        out.append(f"{MODEL_NAMES.get(model, model)} {klabel(length, 1024)}: {', '.join(cells)} ({_samples(n)})")
    return "; ".join(out)


def _samples(n: int) -> str:
    """``"1 sample"``, ``"10 samples"``."""
    return f"{n} sample" + ("" if n == 1 else "s")


#: companion folders of a run (``<run><suffix>``): the same samples answered with other settings, no full rows
RULER_COMPANIONS = {"_variants": "variants", "_settings": "with the model's settings"}


def _ruler_companion_rows(d: Path, label: str) -> str:
    """A companion folder's rows (every method but full attention and the exact oracle), averaged per length,
    with the sample count."""
    avg = [r for r in read_csv(d / "results.csv") if r["task"] == "average" and r["method"] not in ("full", "exact")]
    out = []
    for length in sorted({int(r["length"]) for r in avg}):
        rs = [r for r in avg if int(r["length"]) == length]
        cells = [f"{r['method']}@{r['budget']} {float(r['score']):.1f}" for r in rs]
        out.append(f"{klabel(length, 1024)}: {', '.join(cells)} ({_samples(min(int(r['samples']) for r in rs))})")
    state = ", running" if (d / "results.md").read_text().startswith("Partial run") else ""
    return f"{label} ({link(f'experiments/ruler/{d.name}/')}{state}) " + "; ".join(out)


def ruler_run(d: Path) -> str:
    """One RULER folder: its averages when final, else 'running (N finished units)' and, when a partial snapshot
    wrote its tables, the averages so far."""
    units = _ruler_units(d / "predictions.jsonl")
    md = (d / "results.md").read_text() if (d / "results.md").exists() else ""
    m = re.search(r"Predictions: (\d+) units", md)
    final = (d / "results.csv").exists() and m is not None and int(m.group(1)) >= units and "(interrupted)" not in md
    if not final:
        so_far = f"; so far {_ruler_averages(d)}" if (d / "results.csv").exists() and md.startswith("Partial run") else ""
        return f"{link(f'experiments/ruler/{d.name}/')}: running ({units} finished units in `predictions.jsonl`{so_far})"
    return f"{link(f'experiments/ruler/{d.name}/')}: " + _ruler_averages(d)


def _ruler_run_order(d: Path) -> tuple[str, int, str]:
    """Runs by model, then context length (``gemma_4k`` before ``gemma_16k``), then name."""
    m = re.match(r"(.*?)_(\d+)k(.*)$", d.name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else (d.name, 0, "")


def row_ruler() -> tuple[str, str, str]:
    base = EXP / "ruler"
    # shared_prefill_* runs time the shared prefill (2 samples per task), kvpress_*_check runs cross-check one
    # baseline on a few samples, and runs without full attention's rows are ablations of one method (e.g.
    # gemma_8k_page4/): none is a results table
    runs = sorted((d for d in base.iterdir() if d.is_dir() and (d / "predictions.jsonl").exists()
                  and not d.name.startswith("shared_prefill") and not d.name.endswith("_check")
                  and '"method": "full"' in (d / "predictions.jsonl").read_text()), key=_ruler_run_order) if base.is_dir() else []
    if not runs:
        return ("RULER accuracy (average score x100)", "`icecache eval ruler`", "not run yet")
    cells = []
    for d in runs:
        cell = ruler_run(d)
        for suffix, label in RULER_COMPANIONS.items():
            companion = base / f"{d.name}{suffix}"
            if (companion / "results.csv").exists() and (companion / "results.md").exists():
                cell += "; " + _ruler_companion_rows(companion, label)
        cells.append(cell)
    text = "; ".join(cells)
    if (base / "targets.md").exists():  # experiments/ruler/targets.py: each target's verdict per model and length
        text += f"; every target per model and length: {link('experiments/ruler/targets.md')}"
    return ("RULER accuracy (average score x100)", link("experiments/ruler/", full=True), text)


def row_index() -> tuple[str, str, str]:
    bi = EXP / "bench_index"

    def recall(path: Path, method: str) -> float:
        return next(float(r["attention_recall"]) for r in read_csv(path) if r["method"] == method and r["budget"] == "128")

    wide = bi / "wide_smollm2_8k" / "quality_summary.csv"
    cap = [r for r in read_csv(bi / "scaling_capped" / "scaling_summary.csv") if r["data"] == "real"]
    at = next(r for r in cap if int(r["n"]) == 131072)
    speed = float(at["exact_select_ms@128"]) / float(at["mdci_select_ms@128"])
    rel = float(at["mdci_recall@128"]) / float(at["exact_recall@128"])
    a = slope([float(r["n"]) for r in cap], [float(r["mdci_select_ms@128"]) for r in cap])
    sw = next(r for r in read_csv(bi / "scaling_wide" / "scaling_summary.csv") if r["data"] == "real" and int(r["n"]) == 131072)
    ex = float(sw["exact_recall@128"])
    head = (f"attention recall @128 ({link('experiments/bench_index/wide_smollm2_8k/')}): M-DCI {recall(wide, 'mdci'):.3f} with the "
            f"default `wide` search ({recall(wide, 'mdci[icecache]'):.3f} with the published parameters), Quest pages "
            f"{recall(wide, 'sequential'):.3f}; k-means pages {recall(bi / 'quality_summary.csv', 'kmeans'):.3f} "
            f"({link('experiments/bench_index/bench_index.md')}); at {klabel(int(at['n']), 1024)} real keys "
            f"({link('experiments/bench_index/scaling_capped/')}) {times(speed)} faster than exact (select time ~ n^{a:.2f}) "
            f"but {rel:.2f} of its recall: pages of 16 cap it (k-means pages {float(sw['kmeans_recall@128']) / ex:.2f}, pages of 1 "
            f"{float(sw['mdci[P1]_recall@128']) / ex:.2f}, {link('experiments/bench_index/scaling_wide/')}; "
            "[long-context section](experiments/bench_index/README.md#long-contexts-the-field-of-view-cap-and-the-page-granularity-limit-issue-3-part-b-2026-11-30))")
    return ("index quality and speed", link("experiments/bench_index/bench_index.md", full=True), head)


def row_backends() -> tuple[str, str, str]:
    return ("pager backends", link("experiments/bench_index/README.md", full=True),
            "Pareto front: M-DCI (fov 10/20, 2means), IVF, exact; HNSW dominated; M-DCI's default search (`wide` preset) "
            "vs the published parameters")


def _ratio(variants: dict, name: str) -> float:
    """Median over rounds of the variant's step time over full attention's in the same round."""
    full = variants["full"]["block_median_ms"]
    return statistics.median(v / f for v, f in zip(variants[name]["block_median_ms"], full))


def row_decode() -> tuple[str, str, str]:
    br = EXP / "bench_runtime"
    latest = read_json(br / "interleaved_8k_merge" / "tpot_interleaved.json")
    before = read_json(br / "interleaved_8k_before" / "tpot_interleaved.json")
    v = latest["variants"]
    ice = v["mdci@256"]
    stages = ice["stage_ms_per_step"]
    top = max(stages, key=stages.get)
    c = ice["copies_per_layer_step"]
    copies = "one copy" if c == 1 else f"{c:.2f} copies"
    sc, ss = read_json(br / "select_cost" / "select_cost.json"), read_json(br / "select_cost_streamed" / "select_cost.json")
    head = (f"{klabel(latest['context'])}, budget 256, interleaved rounds ({link('experiments/bench_runtime/interleaved_8k_merge/')}, "
            f"latest, {latest['reps']} rounds): TPOT **{times(_ratio(v, 'mdci@256'))}** full with the default search (was "
            f"{times(_ratio(before['variants'], 'mdci@256'))} before the streamed select, "
            f"{link('experiments/bench_runtime/interleaved_8k_before/')}), **{times(_ratio(v, 'mdci[preset=icecache]@256'))}** "
            f"with the published parameters; Quest pages **{times(_ratio(v, 'sequential@256'))}**: faster than IceCache here; "
            f"device KV {100 * ice['device_kv_fraction']:.1f}% of full, {copies} per layer step; "
            f"{top} (the largest stage, {stages[top]:.1f} ms per step) streams run-ordered keys: {sc['model_pagers']['selects']} "
            f"selects {sc['model_pagers']['round_robin_ms']:.1f} -> {ss['model_pagers']['round_robin_ms']:.1f} ms "
            f"({link('experiments/bench_runtime/select_cost/')}, {link('experiments/bench_runtime/select_cost_streamed/')})")
    chain = ("interleaved_8k_nocopy", "interleaved_8k_hotpath", "interleaved_8k_sampled", "interleaved_8k_autostep",
             "interleaved_8k_ompworker", "interleaved_8k_capacity", "interleaved_8k_inline", "interleaved_8k_parallel",
             "interleaved_8k_s13")
    runs = {name: read_json(br / name / "tpot_interleaved.json")["variants"] for name in chain}
    floor = next(name for name in runs["interleaved_8k_sampled"] if name.startswith("floor@"))
    to_floor = lambda name: " -> ".join(times(r[name]["ratio_vs_floor_median"]) for r in runs.values())
    links = " -> ".join(link(f"experiments/bench_runtime/{name}/") for name in chain)
    head += (f"; against the step's floor (full attention at {floor.split('@')[1]} tokens = sink + window + budget, same "
             f"rounds; before -> compiled hot path -> sampled top-k and cold-calibrated auto -> auto calibrated on select + "
             f"insert -> decode inserts on one intra-op thread -> buffers built with spare room -> inserts inline (the default on a CPU whose cores all run the model) -> the exact scan on both cores, one "
             f"compiled select per layer -> M-DCI's layer select and common insert compiled, {links}): "
             f"exact {to_floor('exact@256')}, M-DCI {to_floor('mdci@256')}, `index=\"auto\"` {to_floor('auto@256')}, Quest pages "
             f"{to_floor('sequential@256')} (issue 24's target 1.2x and <= Quest: missed)")
    old_w, new_w = (read_json(br / name / "tpot_interleaved.json")["variants"]
                    for name in ("interleaved_8k_c91157f", "interleaved_8k_ompworker"))
    ms = lambda name: f"{old_w[name]['median_step_ms']:.1f} -> {new_w[name]['median_step_ms']:.1f}"
    head += (f"; the last step made every step of that interleaved run faster and the floor honest (the old insert worker's OpenMP threads had "
             f"slowed the full-attention rows of every earlier run too; same command on the previous commit, back to back, "
             f"{link('experiments/bench_runtime/interleaved_8k_c91157f/')}): ms per step exact {ms('exact@256')}, auto "
             f"{ms('auto@256')}, M-DCI {ms('mdci@256')}, Quest pages {ms('sequential@256')}, full {ms('full')}, floor "
             f"{ms(floor)}")
    fresh = [json.loads(line) for line in (br / "fresh_ab_capacity" / "runs.jsonl").read_text().splitlines() if line.strip()]

    def fresh_ms(pager: str, context: int, budget: int) -> str:
        mean = {side: statistics.mean(r["tpot_ms"] for r in fresh
                                      if (r["side"], r["pager"], r["context"], r["budget"]) == (side, pager, context, budget))
                for side in ("a", "b")}
        return f"{mean['a']:.1f} -> {mean['b']:.1f}"

    head += (f"; one generate per fresh process, c91157f -> now ({link('experiments/bench_runtime/fresh_ab_capacity/')}, "
             f"after the fix of the growth regression that the thread change exposed), TPOT at 8k, budget 64: M-DCI "
             f"{fresh_ms('icecache', 8000, 64)} ms, exact {fresh_ms('exact', 8000, 64)}, Quest pages {fresh_ms('quest', 8000, 64)}")
    pairs = ("sync", "sync2", "repage", "stored", "stored2")
    auto_runs = [("2k", tuple(f"interleaved_2k_{p}" for p in pairs)),
                 ("8k", tuple(f"interleaved_8k_{p}" for p in pairs)),
                 ("Gemma-3 32k", ("interleaved_gemma_32k_inline",))]
    gaps = []
    for label, names in auto_runs:
        cells, chose = [], None
        for name in names:
            var = read_json(br / name / "tpot_interleaved.json")["variants"]
            best = min(var["exact@256"]["median_step_ms"], var["mdci@256"]["median_step_ms"])
            cells.append(f"{100 * (var['auto@256']['median_step_ms'] / best - 1):+.1f}%")
            chose = var["auto@256"]["index"]
        gaps.append(f"{label} {' / '.join(cells)} (chose {chose})")
    gemma = read_json(br / "interleaved_gemma_32k_inline" / "tpot_interleaved.json")["variants"]
    runs = ", ".join(link(f"experiments/bench_runtime/interleaved_{size}_{p}/") for p in pairs for size in ("2k", "8k"))
    head += (f"; `index=\"auto\"` (M-DCI's pages scored exhaustively below the crossover since 2026-12-05) vs the "
             f"faster of exact and M-DCI, {len(pairs)} interleaved runs each, oldest first ({runs}; the last three after "
             f"the compiled re-paging, the last two also after the compiled decode insert): "
             f"{', '.join(gaps)} (target within 5%); Gemma-3-270M at "
             f"32k ({link('experiments/bench_runtime/interleaved_gemma_32k_inline/')}): IceCache (auto) "
             f"**{times(gemma['auto@256']['ratio_vs_floor_median'])}** the full-attention step at 2k (target 1.1x)")
    return ("decode speed and memory", link("experiments/bench_runtime/README.md", full=True), head)


def row_sim() -> tuple[str, str, str]:
    sim = EXP / "sim"
    paper = (sim / "paper_a100.md").read_text()

    def cells(label: str) -> list[str]:
        m = re.search(r"^\| " + re.escape(label) + r" \|(.*)\|\s*$", paper, re.M)
        return [c.strip() for c in m.group(1).split("|")]

    p, fed, pred = cells("paper"), cells("engine fed the paper's components"), cells("predicted from the profiles")
    tt2t = re.search(r"predicted from the profiles.*?\n\|\s*\(TT2T ([\d.]+) s; paper ([\d.]+) s\)", paper)
    scale = re.search(r"Host time scale ([\d.]+)", paper).group(1)
    v = read_json(sim / "validation.json")
    runs = [json.loads(line) for line in (sim / "measured_runs.raw.jsonl").read_text().splitlines() if line.strip()]
    configs = {(r["variant"], r["context"], r["budget"], r["page_size"], r["threads"], r["reuse_every"]) for r in runs}
    rounds = {r["round"] for r in runs}
    held = "/".join(klabel(c) for c in sorted({r["context"] for r in v["rows"]}))
    met = all(ok for key, ok in v["passes_corrected"].items() if key.startswith(("tpot", "tt2t")))
    tau_key = next(k for k in v["passes_corrected"] if k.startswith("Kendall"))
    tau_target = re.search(r">= ([\d.]+)", tau_key).group(1)
    cross = (sim / "crossover_h100_qwen3.txt").read_text()
    ours = int(re.search(r"icecache vs full KV on h100\S* / qwen3-4b .*?becomes faster at (\d+)k", cross).group(1))
    theirs = int(re.search(r"paper \(lines through its two points\): (\d+)k", cross).group(1))
    head = (f"A100 breakdown ({link('experiments/sim/paper_a100.md')}): TPOT {fed[0]} s = the paper's {p[0]} **by construction** "
            f"(the paper's component times go in, and the host time scale {scale} is fitted to its DCI time); the genuine "
            f"prediction from our profiles: TPOT {pred[0]} s vs the paper's {p[0]}, load {pred[3]} s vs {p[3]}, TT2T "
            f"{tt2t.group(1)} s vs {tt2t.group(2)}; validation ({link('experiments/sim/validation.md')}) on {len(configs)} "
            f"configurations x {len(rounds)} shuffled rounds, {held} held out: TPOT {100 * v['corrected']['tpot']['mape']:.1f}% MAPE / "
            f"{pct(v['corrected']['tpot']['bias'])} bias with corrections, TT2T {100 * v['corrected']['tt2t']['mape']:.1f}% / "
            f"{pct(v['corrected']['tt2t']['bias'])} (raw {100 * v['raw']['tt2t']['mape']:.1f}% / {pct(v['raw']['tt2t']['bias'])}): "
            f"{'met' if met else 'missed'}; "
            f"Kendall tau {v['tau_corrected']:.3f} (target {tau_target}, {'met' if v['passes_corrected'][tau_key] else 'missed'}; "
            f"{v['tau_resolved_corrected']:.3f} over the pairs the measurements resolve); H100/Qwen3-4B crossover {ours}k vs the "
            f"paper's {theirs}k ({pct(change(ours, theirs), 0)}, missed; {link('experiments/sim/crossover_h100_qwen3.txt')})")
    return ("simulator", link("experiments/sim/README.md", full=True), head)


def row_reliability() -> tuple[str, str, str]:
    rel = EXP / "reliability"
    first = read_json(rel / "soak_tiny_bg_interleaved" / "drift_vs_sim.json")
    second = {r["pager"]: r for r in read_json(rel / "soak_tiny_bg_interleaved2" / "drift_vs_sim.json")}

    def trio(r: dict) -> str:
        return (f"{pct(r['drift_vs_reference'])} / {pct(r['drift_vs_reference_apart_from_sim_growth'])} / "
                f"**{pct(r['drift_vs_reference_apart_from_sim_step_growth'])}**")

    pagers = []
    for r in first:
        again = second.get(r["pager"])
        pagers.append(f"{r['pager']} {trio(r)}" + (f" (repeat {trio(again)})" if again else ""))
    whole = [r["drift_vs_reference_apart_from_sim_step_growth"] for r in first]
    spread = max(abs(r["drift_vs_reference_apart_from_sim_step_growth"] - second[r["pager"]]["drift_vs_reference_apart_from_sim_step_growth"])
                 for r in first if r["pager"] in second)
    reps: dict[str, list[float]] = {}
    for r in read_json(rel / "drift_bg_repeats.json"):
        reps.setdefault(r["pager"], []).append(r["drift_apart_from_sim_growth"])
    plain = max(max(v) - min(v) for v in reps.values())
    target = float(re.search(r"target: [^)]*?at most \+([\d.]+)%", (rel / "drift_bg_repeats.md").read_text()).group(1)) / 100
    model = read_json(rel / "soak_model_mdci_merge" / "drift_vs_sim_decode.json")[0]
    hnsw_before = next(r for r in read_json(rel / "soak_tiny" / "soak.json")["runs"] if r["index"] == "hnsw")
    trim = read_json(rel / "soak_hnsw_trim" / "soak.json")["runs"][0]
    pin = read_json(rel / "soak_hnsw_pinned" / "soak.json")["runs"][0]
    builds = re.search(r"builds of 8k keys\s+([\d.]+-[\d.]+) s vs ([\d.]+-[\d.]+) s", (EXP / "reliability.md").read_text())
    over = [r["pager"] for r in first if r["drift_vs_reference_apart_from_sim_growth"] > target]

    def tokens(run: str) -> str:
        return "/".join(sorted({klabel(r["new_tokens"]) for r in read_json(rel / run / "soak.json")["runs"]}))

    head = (f"soak, faults, fuzzing, untrusted files; TPOT drift over {tokens('soak_tiny_bg_interleaved')} tokens, given as raw / apart from the simulator's index "
            f"work alone / apart from its whole-step growth (target {pct(target, 0)}): tiny model, every pager, against a warm reference cache "
            f"decoding at the same moments ({link('experiments/reliability/soak_tiny_bg_interleaved/')}, repeat "
            f"{link('experiments/reliability/soak_tiny_bg_interleaved2/')}): {', '.join(pagers)}; whole-step: "
            f"{sum(w <= target for w in whole)} of {len(whole)} pagers within the target; index work alone: "
            f"{', '.join(over) or 'none'} over (a large index slows the rest of the step: "
            f"{link('experiments/reliability/pollution_probe_exact.json')}); lockstep repeats agree within {100 * spread:.1f} points, "
            f"plain soaks of the same code spread up to {100 * plain:.1f} points ({link('experiments/reliability/drift_bg_repeats.md')}); "
            f"SmolLM2 {tokens('soak_model_mdci_merge')} soak ({link('experiments/reliability/soak_model_mdci_merge/')}): TPOT {model['tpot_warm_ms']:.1f} -> "
            f"{model['tpot_end_ms']:.1f} ms, {pct(model['tpot_drift'])} raw / {pct(model['drift_apart_from_sim_growth'])} apart from "
            f"the index work / **{pct(model['drift_apart_from_sim_growth_and_dense'])}** apart from the index and dense-layer "
            f"growth (simulator calibrated inside the runtime); long-run RSS growth traced to glibc's dynamic mmap threshold; "
            f"`heap_policy=\"trim\"` (default) bounds it (hnsw {tokens('soak_hnsw_trim')} soak: {kb(hnsw_before['rss_slope_bytes_per_step'])} -> "
            f"{kb(trim['rss_slope_bytes_per_step'])} KB per step, {link('experiments/reliability/soak_hnsw_trim/')}), `\"pin\"` "
            f"removes it ({kb(pin['rss_slope_bytes_per_step'])} KB per step) at slower index builds ({builds.group(1)} s instead of "
            f"{builds.group(2)} s, {link('experiments/reliability.md')})")
    return ("reliability", link("experiments/reliability/README.md", full=True), head)


SERVING_RUN = "serving/speed_2026-12-02"


def row_serving() -> tuple[str, str, str]:
    """The vLLM plugin's decode speed against vLLM's dense CPU backend (same run), and the HF runtime at batch 1."""
    res = read_json(EXP / SERVING_RUN / "speed.json")
    tpot = {(r["engine"], r["context"], r["batch"]): r["tpot_ms"] for r in res["rows"]}
    cells = []
    for context, batch in sorted({(c, b) for _, c, b in tpot}, key=lambda cb: (cb[1], cb[0])):
        dense = tpot[("dense", context, batch)]
        ours = ", ".join(f"{e.split()[-1]} {tpot[(e, context, batch)]:.0f} ms ({times(tpot[(e, context, batch)] / dense)})"
                         for e, c, b in tpot if (c, b) == (context, batch) and e != "dense")
        cells.append(f"{klabel(context)} x {batch}: dense {dense:.0f} ms, {ours}")
    hf = res.get("hf_runtime_step_ms", {})
    hf_cells = [f"{klabel(int(c))}: full {v['full']:.0f}, exact@256 {v['exact@256']:.0f}, mdci@256 {v['mdci@256']:.0f} ms"
                for c, v in sorted(hf.items(), key=lambda kv: int(kv[0]))]
    head = (f"TPOT, vLLM plugin vs vLLM's dense CPU backend, one interleaved run ({link(f'experiments/{SERVING_RUN}/')}): "
            + "; ".join(cells) + (f"; icecache's HF runtime, batch 1 ({res['hf_threads']} thread): " + "; ".join(hf_cells) if hf_cells else "")
            + "; correctness (token-for-token vs stock vLLM and the HF runtime, concurrency, aborts, preemption): `make test-serve`")
    return ("serving with vLLM (CPU)", link("docs/serving.md", full=True), head)


def row_top_p() -> tuple[str, str, str]:
    """The adaptive budget: passkey and RULER NIAH scores with and without top-p, and the tokens attended."""
    d = EXP / "top_p"

    def passkey(run: str) -> dict[tuple[int, int], tuple[float, float]]:
        rows = read_json(d / run / "results.json")["rows"]
        out = {}
        for key in sorted({(r["length"], r["budget"]) for r in rows}):
            rs = [r for r in rows if (r["length"], r["budget"]) == key]
            out[key] = (sum(r["score"] for r in rs) / len(rs), sum(r["tokens_per_selection"] for r in rs) / len(rs))
        return out

    fixed, cut = passkey("passkey_none"), passkey("passkey_p0.9")
    cells = [f"{klabel(n)}@{b}: {fixed[(n, b)][0]:.2f} -> {cut[(n, b)][0]:.2f}, {fixed[(n, b)][1]:.0f} -> {cut[(n, b)][1]:.0f} tok"
             for n, b in sorted(fixed, key=lambda nb: (nb[1], nb[0]))]
    ruler = read_json(d / "ruler_niah_4k.json")
    rcells = [f"p {t['p']}: {ruler['fixed']:.3f} -> {t['score']:.3f}, {t['tokens_per_selection']:.0f} tok, {t['differ']} samples differ"
              for t in ruler["top_p"]]
    head = ("passkey, 10 samples, score and middle tokens per selection, fixed budget -> top-p 0.9: " + "; ".join(cells)
            + f"; RULER NIAH 4k, {ruler['row']} on {ruler['samples']} samples (full {ruler['full']:.3f}): " + "; ".join(rcells))
    return ("adaptive budget (top-p, issue 24)", link("experiments/top_p/README.md", full=True), head)


def results_table() -> str:
    rows = [row_accuracy(), row_ruler(), row_index(), row_backends(), row_decode(), row_top_p(), row_sim(),
            row_reliability(), row_serving()]
    lines = ["| what | where | headline |", "|---|---|---|"]
    lines += [f"| {w} | {where} | {h} |" for w, where, h in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- the long-context table


def longctx_table() -> str:
    rows = read_csv(EXP / "longctx" / "gemma_tpot_memory.csv")
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
    """The RULER row with its live parts as one state: a running run's unit count is not a claim, and a row
    with no final results (running or absent) compares equal to any other such row."""
    if not line.startswith("| RULER"):
        return line
    if not re.search(r"\(\d+ samples\)", line):
        return "| RULER | (no final results) |"
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
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's generated blocks are out of date")
    args = ap.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    blocks = render()
    if args.check:
        diffs = check(text, blocks)
        if diffs:
            print("README.md out of date (run `make results`): " + "; ".join(diffs))
            return 1
        return 0
    new = replace_blocks(text, blocks)
    if new != text:
        README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
