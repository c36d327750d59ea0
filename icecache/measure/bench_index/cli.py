"""The ``icecache bench index`` command: arguments, capture, part A, part B, report and files (`main`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icecache.core.errors import ConfigError
from icecache.core.report import md_table, write_csv
from icecache.core.spec import format_spec, parse_params, parse_spec
from icecache.measure.bench_index.plots import pareto_front, plot_pareto, plot_results
from icecache.measure.bench_index.quality import PARETO_SWEEP, evaluate_head
from icecache.measure.bench_index.scaling import scaling_point, slope, synthetic_clustered

__all__ = ["DEFAULT_SIZES", "WINDOW_TOKENS", "build_parser", "parse_variant", "main", "BenchResults", "run_quality", "run_scaling"]

DEFAULT_SIZES = (8192, 16384, 32768, 65536, 131072, 262144)
#: tokens per captured window of part B (consecutive windows of the long text, RoPE positions continued)
WINDOW_TOKENS = 8192
DESCRIPTION = "``icecache bench index``: page-selection quality and speed of the pagers on real keys and queries."


def _params_arg(spec: str) -> dict[str, Any]:
    """`icecache.core.spec.parse_params` as an argparse type (its message on a malformed item)."""
    try:
        return parse_params(spec)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_variant(text: str, mdci_defaults: dict[str, Any]) -> tuple[str, tuple[str, dict[str, Any]]]:
    """``"SPEC"`` or ``"NAME=SPEC"`` (`icecache.core.spec`) -> ``(NAME, (pager, params))``: ``"hnsw[ef=16]"``
    is named by its spec, ``"F30=mdci[field_of_view=30]"`` by ``F30``; an mdci spec starts from ``--mdci``'s
    parameters. (Until 2026-12-07 this was ``NAME:k=v`` for ``NAME=mdci[k=v]`` and ``NAME=PAGER:k=v``.)"""
    label, sep, rest = text.partition("=")
    if sep and "[" not in label:
        name, spec = label.strip(), rest
    else:
        name, spec = None, text
    pager, params = parse_spec(spec)
    if pager == "mdci":
        params = {**mdci_defaults, **params}
    return name or format_spec(pager, parse_spec(spec)[1]), (pager, params)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="icecache bench index", allow_abbrev=False, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, .gguf file or directory (default: embedded SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length of part A (default 8192)")
    p.add_argument("--text", choices=("docs", "stdlib"), default="docs",
                   help="prompt corpus: Python's documentation (prose, default) or the standard library's sources (code)")
    p.add_argument("--steps", type=int, default=32, help="decode-step queries per head: the last N positions (default 32)")
    p.add_argument("--budgets", default="64,128,256", help="comma-separated token budgets (default 64,128,256)")
    p.add_argument("--page-size", type=int, default=16, help="page capacity P (default 16)")
    p.add_argument("--sink", type=int, default=4, help="sink tokens (default 4)")
    p.add_argument("--window", type=int, default=64, help="recent-window tokens (default 64)")
    p.add_argument("--dense-layers", default="0,1", help="layers with full attention, excluded (default 0,1)")
    p.add_argument("--layers", default=None, help="comma-separated layers of part A (default: every non-dense layer)")
    p.add_argument("--seed", type=int, default=0, help="seed of every pager and of k-means (default 0)")
    p.add_argument("--mdci", default="", type=_params_arg, help="mdci parameters, e.g. 'field_of_view=60,p0=0.05'")
    p.add_argument("--pagers", default="mdci,ivf,hnsw,pq",
                   help="registered pagers compared in part A besides exact and sequential (default mdci,ivf,hnsw,pq)")
    p.add_argument("--pareto", action="store_true",
                   help="also sweep each backend's speed/quality knob and plot attention recall vs select time (pareto.*)")
    p.add_argument("--variant", action="append", default=[], metavar="[NAME=]PAGER[K=V;...]",
                   help="an extra pager configuration to compare in part A (repeatable), e.g. 'F30=mdci[field_of_view=30]' "
                        "or 'hnsw[ef=16]'; an mdci one starts from --mdci")
    p.add_argument("--no-kmeans", action="store_true", help="skip the k-means reference")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="part B key counts (multiples of 8192)")
    p.add_argument("--scaling-layers", default="2,4", help="layers captured for part B (default 2,4)")
    p.add_argument("--scaling-queries", type=int, default=8, help="query positions per part-B point (default 8)")
    p.add_argument("--scaling-budgets", default="128", help="comma-separated budgets of part B (default 128)")
    p.add_argument("--scaling-variant", action="append", default=[], metavar="[NAME=]mdci[K=V;...]",
                   help="an extra mdci configuration for part B (repeatable), e.g. 'F30=mdci[fov_scale=0]'")
    p.add_argument("--scaling-kmeans", action="store_true",
                   help="part B, real keys: also the k-means page reference (as many pages as mdci; slow at 128k+)")
    p.add_argument("--no-scaling", action="store_true", help="skip part B")
    p.add_argument("--no-quality", action="store_true", help="skip part A")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--quick", action="store_true", help="a short run: 4096 tokens, 4 steps, 3 layers, sizes up to 32k")
    p.add_argument("--out", default=None, help="write CSV, Markdown and PNG results to this directory")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's arguments, with ``--quick`` applied."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.quick:
        args.tokens, args.steps = 4096, 4
        args.layers = args.layers or "2,15,29"
        args.sizes = "8192,16384,32768"
        args.scaling_layers = "2"
    return args


def part_a_variants(args: argparse.Namespace) -> dict[str, tuple[str, dict[str, Any]]]:
    """Part A's methods besides ``exact`` and ``sequential``: name -> (pager, parameters); ``mdci`` first."""
    variants: dict[str, tuple[str, dict[str, Any]]] = {"mdci": ("mdci", dict(args.mdci))}
    for name in filter(None, (x.strip() for x in args.pagers.split(","))):
        if name not in ("mdci", "exact", "sequential"):
            variants[name] = (name, {})
    for v in args.variant:
        variants.update([parse_variant(v, dict(args.mdci))])
    if args.pareto:
        variants.update(PARETO_SWEEP)
    return variants


@dataclass
class BenchResults:
    """What the parts produce: Markdown lines, CSV tables (file name -> rows), target lines, and what the plots
    and the header need."""

    report: list[str] = field(default_factory=list)
    csv_out: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)
    summary_quality: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    scaling_rows: list[dict[str, Any]] = field(default_factory=list)


def _quality_rows(model: Any, ids: torch.Tensor, args: argparse.Namespace, layers: Sequence[int], budgets: Sequence[int],
                  variants: dict[str, tuple[str, dict[str, Any]]]) -> tuple[list[dict[str, Any]], dict, dict, dict, dict[str, float]]:
    """Capture the prompt, time full-attention decode steps, run every method on every (layer, KV head)."""
    from tqdm import tqdm

    from icecache.measure.capture import capture_kv, time_decode_steps

    n_kv = model.config.num_key_value_heads
    rep = model.config.num_attention_heads // n_kv
    cap = capture_kv(model, ids, last_queries=args.steps, keep_cache=True)
    dec = time_decode_steps(model, cap.past_key_values, int(ids[0, -1]), num_steps=5)
    cap.past_key_values = None
    info = {"prefill_s": cap.seconds, "decode_step_ms": 1e3 * float(np.median(dec))}
    all_rows: list[dict[str, Any]] = []
    builds: dict[str, list[float]] = {}
    selects: dict[tuple[str, int], list[float]] = {}  # per (method, budget): per-head mean select time
    pages: dict[str, list[int]] = {}
    heads = [(layer_idx, h) for layer_idx in layers for h in range(n_kv)]
    for layer_idx, h in tqdm(heads, desc="part A: layers x KV heads", unit="head", file=sys.stderr):
        K = cap.keys[layer_idx][h]
        V = cap.values[layer_idx][h]
        Q = cap.queries[layer_idx][h * rep : (h + 1) * rep].transpose(0, 1).contiguous()  # [S, g, d]
        r = evaluate_head(K, V, Q, budgets=budgets, page_size=args.page_size, sink=args.sink, window=args.window,
                          seed=args.seed, variants=variants, with_kmeans=not args.no_kmeans)
        for row in r.rows:
            row.update(layer=layer_idx, head=h)
            all_rows.append(row)
        for k, v in r.build_s.items():
            builds.setdefault(k, []).append(v)
        for k, v in r.select_s.items():
            selects.setdefault(k, []).append(float(np.median(v)))  # robust to load spikes
        for k, v in r.num_pages.items():
            pages.setdefault(k, []).append(v)
    return all_rows, builds, selects, pages, info


def run_quality(model: Any, ids: torch.Tensor, args: argparse.Namespace, layers: Sequence[int], budgets: Sequence[int],
                variants: dict[str, tuple[str, dict[str, Any]]], res: BenchResults) -> dict[str, float]:
    """Part A: quality and speed tables, the Pareto view and the issue's targets, into ``res``. Returns the
    prefill and decode-step timings of the captured prompt (``prefill_s``, ``decode_step_ms``)."""
    n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    all_rows, builds, selects, pages, info = _quality_rows(model, ids, args, layers, budgets, variants)
    report, summary_quality = res.report, res.summary_quality
    methods = list(dict.fromkeys(r["method"] for r in all_rows))
    # Per (method, budget, layer) means, and overall means (each layer weighs the same).
    per_layer: list[dict[str, Any]] = []
    for m in methods:
        for b in budgets:
            layer_means = {}
            for layer in layers:
                sel = [r for r in all_rows if r["method"] == m and r["budget"] == b and r["layer"] == layer]
                row = {"method": m, "budget": b, "layer": layer}
                for key in ("hit_rate", "attention_recall", "output_error", "tokens"):
                    row[key] = float(np.mean([r[key] for r in sel]))
                per_layer.append(row)
                layer_means[layer] = row
            summary_quality[(m, b)] = {
                key: float(np.mean([layer_means[layer][key] for layer in layers]))
                for key in ("hit_rate", "attention_recall", "output_error", "tokens")
            }
    res.csv_out["quality_per_layer.csv"] = per_layer
    qrows = [{"method": m, "budget": b, **summary_quality[(m, b)]} for m in methods for b in budgets]
    res.csv_out["quality_summary.csv"] = qrows
    report.append(f"### Part A: selection quality ({args.tokens} tokens, {len(layers)} sparse layers x {n_kv} KV heads, "
                  f"{args.steps} decode steps, page size {args.page_size}, sink {args.sink}, window {args.window})\n")
    report.append("Means over sparse layers (each layer weighs the same), KV heads and decode steps.\n")
    report.append(md_table(["method", "budget", "hit rate", "attention recall", "output error", "tokens used"],
                           [[r["method"], r["budget"], r["hit_rate"], r["attention_recall"], r["output_error"], r["tokens"]] for r in qrows]))
    # Per-layer recall at the middle budget.
    bmid = 128 if 128 in budgets else budgets[len(budgets) // 2]
    report.append(f"\nAttention recall per layer at budget {bmid}:\n")
    report.append(md_table(["layer"] + methods, [[layer] + [next(r["attention_recall"] for r in per_layer if r["method"] == m and r["budget"] == bmid
                                                             and r["layer"] == layer) for m in methods] for layer in layers]))
    # Timing.
    trows = []
    n_groups = len(layers) * n_kv
    for m in builds.keys() | {k[0] for k in selects}:
        row = {"method": m, "build_ms_per_head": 1e3 * float(np.mean(builds[m])) if m in builds else float("nan"),
               "pages_per_head": float(np.mean(pages[m])) if m in pages else float("nan")}
        for b in budgets:
            v = selects.get((m, b))
            row[f"select_ms_per_group@{b}"] = 1e3 * float(np.mean(v)) if v else float("nan")
            row[f"select_ms_per_step@{b}"] = 1e3 * float(np.mean(v)) * n_groups if v else float("nan")
        trows.append(row)
    trows.sort(key=lambda r: methods.index(r["method"]) if r["method"] in methods else 99)
    res.csv_out["timing.csv"] = trows
    report.append(f"\n### Part A: speed (this machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()})\n")
    report.append(f"Model prefill of {args.tokens} tokens (decoder forward, capture on): {info['prefill_s']:.2f} s; "
                  f"one full-attention decode step at that context: {info['decode_step_ms']:.1f} ms (median of 5).\n")
    hdr = ["method", "build ms/head", "pages/head"] + [f"select ms/group @{b}" for b in budgets] + [f"select ms/step @{b} ({n_groups} groups)" for b in budgets]
    report.append(md_table(hdr, [[r["method"], r["build_ms_per_head"], r["pages_per_head"]] + [r[f"select_ms_per_group@{b}"] for b in budgets]
                                 + [r[f"select_ms_per_step@{b}"] for b in budgets] for r in trows]))
    _pareto_section(trows, budgets, variants, n_groups, res)
    _quality_targets(budgets, builds, trows, info, n_layers, n_kv, res)
    return info


def _pareto_section(trows: list[dict[str, Any]], budgets: Sequence[int], variants: dict[str, tuple[str, dict[str, Any]]],
                    n_groups: int, res: BenchResults) -> None:
    """Attention recall vs select time per decode step, every method and variant (``pareto.csv``)."""
    summary_quality = res.summary_quality
    bp = 128 if 128 in budgets else budgets[len(budgets) // 2]
    prow = []
    for r in trows:
        m = r["method"]
        if (m, bp) not in summary_quality or math.isnan(r[f"select_ms_per_step@{bp}"]):
            continue
        prow.append({"method": m, "family": m.split("[")[0], "attention_recall": summary_quality[(m, bp)]["attention_recall"],
                     "hit_rate": summary_quality[(m, bp)]["hit_rate"], "select_ms_per_step": r[f"select_ms_per_step@{bp}"],
                     "build_ms_per_head": r["build_ms_per_head"], "pages_per_head": r["pages_per_head"],
                     "params": json.dumps(variants.get(m, (m, {}))[1])})
    front = pareto_front([(p["select_ms_per_step"], p["attention_recall"]) for p in prow])
    for i, p in enumerate(prow):
        p["pareto_optimal"] = i in front
    res.csv_out["pareto.csv"] = prow
    res.report.append(f"\n### Pareto: attention recall @{bp} vs select time per decode step ({n_groups} GQA groups)\n")
    res.report.append(md_table(["method", "params", "recall", "hit rate", "select ms/step", "build ms/head", "pages/head", "Pareto-optimal"],
                               [[p["method"], p["params"], p["attention_recall"], p["hit_rate"], p["select_ms_per_step"],
                                 p["build_ms_per_head"], p["pages_per_head"], "yes" if p["pareto_optimal"] else ""]
                                for p in sorted(prow, key=lambda p: p["select_ms_per_step"])]))


def _quality_targets(budgets: Sequence[int], builds: dict[str, list[float]], trows: list[dict[str, Any]], info: dict[str, float],
                     n_layers: int, n_kv: int, res: BenchResults) -> None:
    """Issue 3's targets on part A: recall of mdci against sequential and k-means, build and select times."""
    summary_quality, targets = res.summary_quality, res.targets
    if 128 in budgets and 64 in budgets and 256 in budgets:
        rm = lambda m, b: summary_quality[(m, b)]["attention_recall"]
        if ("sequential", 128) in summary_quality:
            d1 = rm("mdci", 128) - rm("sequential", 128)
            targets.append(f"- recall@128 mdci {rm('mdci', 128):.4f} >= sequential {rm('sequential', 128):.4f}: "
                           f"{'MET' if d1 >= 0 else 'MISSED'} (difference {d1:+.4f})")
        if ("kmeans", 128) in summary_quality:
            d2 = rm("mdci", 128) - rm("kmeans", 128)
            targets.append(f"- recall@128 mdci within 0.02 of k-means {rm('kmeans', 128):.4f}: "
                           f"{'MET' if d2 >= -0.02 else 'MISSED'} (difference {d2:+.4f})")
        if ("sequential", 256) in summary_quality:
            d3 = rm("mdci", 64) - rm("sequential", 256)
            targets.append(f"- recall@64 mdci {rm('mdci', 64):.4f} >= sequential@256 {rm('sequential', 256):.4f}: "
                           f"{'MET' if d3 >= 0 else 'MISSED'} (difference {d3:+.4f})")
    bt = 1e3 * float(np.mean(builds["mdci"])) * n_layers * n_kv
    targets.append(f"- build of all {n_layers}x{n_kv} heads ~ {bt / 1e3:.2f} s (mean per head x {n_layers * n_kv}, one thread) "
                   f"< prefill {info['prefill_s']:.2f} s: {'MET' if bt / 1e3 < info['prefill_s'] else 'MISSED'} (ratio {bt / 1e3 / info['prefill_s']:.3f})")
    for b in budgets:
        st = next(r[f"select_ms_per_step@{b}"] for r in trows if r["method"] == "mdci")
        targets.append(f"- mdci select per decode step @{b}: {st:.1f} ms vs full decode step {info['decode_step_ms']:.1f} ms: "
                       f"{'MET' if st < info['decode_step_ms'] else 'MISSED'} (ratio {st / info['decode_step_ms']:.3f})")


def _capture_windows(model: Any, ids_all: torch.Tensor, args: argparse.Namespace, layers: Sequence[int], nwin: int
                     ) -> tuple[dict[int, torch.Tensor], list[dict[int, torch.Tensor]], float]:
    """Keys ``[H_kv, N, d]`` per layer of ``nwin`` consecutive windows of `WINDOW_TOKENS` (RoPE positions continued),
    the last queries of each window per layer, and the capture time (s)."""
    from tqdm import tqdm

    from icecache.measure.capture import capture_kv

    W = WINDOW_TOKENS
    keys_by_layer: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    q_by_window: list[dict[int, torch.Tensor]] = []
    cap_s = 0.0
    for w in tqdm(range(nwin), desc="part B: capturing 8k windows", unit="window", file=sys.stderr):
        cap = capture_kv(model, ids_all[:, w * W : (w + 1) * W], layers=layers, last_queries=args.scaling_queries, position_offset=w * W)
        cap_s += cap.seconds
        for layer in layers:
            keys_by_layer[layer].append(cap.keys[layer])
        q_by_window.append({layer: cap.queries[layer] for layer in layers})
    return {layer: torch.cat(v, dim=1) for layer, v in keys_by_layer.items()}, q_by_window, cap_s


def run_scaling(model: Any, ids_all: torch.Tensor, args: argparse.Namespace, sizes: Sequence[int], mdci_params: dict[str, Any],
                res: BenchResults) -> None:
    """Part B: every mdci variant vs exact over the key counts ``sizes`` (real keys of ``--scaling-layers``, and
    synthetic clustered keys), its table, growth exponents and targets, into ``res``."""
    from tqdm import tqdm

    n_kv = model.config.num_key_value_heads
    rep = model.config.num_attention_heads // n_kv
    s_layers = [int(x) for x in args.scaling_layers.split(",") if x]
    s_budgets = [int(b) for b in args.scaling_budgets.split(",") if b]
    s_variants: dict[str, dict[str, Any]] = {"mdci": mdci_params}
    for v in args.scaling_variant:
        name, (pager, params) = parse_variant(v, mdci_params)
        if pager != "mdci":
            raise ConfigError(f"--scaling-variant {v!r}: part B compares M-DCI variants; write NAME=mdci[k=v;...]")
        s_variants[name] = params
    nwin = max(sizes) // WINDOW_TOKENS
    keys_cat, q_by_window, cap_s = _capture_windows(model, ids_all, args, s_layers, nwin)
    scaling_rows = res.scaling_rows
    pts = [(n, layer_idx, h) for n in sizes for layer_idx in s_layers for h in range(n_kv)]
    for n, layer_idx, h in tqdm(pts, desc="part B: scaling points", unit="point", file=sys.stderr):
        w = n // WINDOW_TOKENS - 1
        Qw = q_by_window[w][layer_idx][h * rep : (h + 1) * rep].transpose(0, 1).contiguous()  # [Qn, g, d]
        positions = [n - args.scaling_queries + i for i in range(args.scaling_queries)]
        r = scaling_point(keys_cat[layer_idx][h, :n].contiguous(), Qw, positions=positions, budgets=s_budgets, page_size=args.page_size,
                          sink=args.sink, window=args.window, seed=args.seed, variants=s_variants,
                          with_kmeans=args.scaling_kmeans)
        r.update(data="real", layer=layer_idx, head=h)
        scaling_rows.append(r)
    for n in tqdm(sizes, desc="part B: synthetic", unit="size", file=sys.stderr):
        Ks, Qs = synthetic_clustered(n, 64, args.seed, args.scaling_queries)
        r = scaling_point(Ks, Qs, positions=None, budgets=s_budgets, page_size=args.page_size, sink=args.sink,
                          window=args.window, seed=args.seed, variants=s_variants)
        r.update(data="synthetic", layer=-1, head=-1)
        scaling_rows.append(r)
    res.csv_out["scaling.csv"] = scaling_rows
    bmid = 128 if 128 in s_budgets else s_budgets[0]
    agg_rows = []
    for data in ("real", "synthetic"):
        for n in sizes:
            rs = [r for r in scaling_rows if r["data"] == data and r["n"] == n]
            a = {k: float(np.mean([r[k] for r in rs])) for k in rs[0] if isinstance(rs[0][k], (int, float)) and k not in ("layer", "head")}
            a.update(data=data, n=n)
            agg_rows.append(a)
    _scaling_report(agg_rows, s_variants, s_layers, n_kv, nwin, cap_s, bmid, args.scaling_queries, res)
    _scaling_targets(agg_rows, s_variants, bmid, res)
    res.csv_out["scaling_summary.csv"] = agg_rows


def _scaling_report(agg_rows: list[dict[str, Any]], s_variants: dict[str, dict[str, Any]], s_layers: list[int], n_kv: int, nwin: int,
                    cap_s: float, bmid: int, num_queries: int, res: BenchResults) -> None:
    kv_fp16 = 2 * 64 * 2
    res.report.append(f"\n### Part B: scaling (budget {bmid}; real = layers {s_layers} x {n_kv} KV heads, "
                      f"{num_queries} query positions each; synthetic = clustered Gaussian keys, d = 64)\n")
    res.report.append(f"Capturing {nwin} windows of {WINDOW_TOKENS} tokens took {cap_s:.1f} s. KV bytes per token per KV head: "
                      f"{kv_fp16} (fp16 K+V), {2 * kv_fp16} (fp32). `X-oracle` = X's pages ranked by their exact best token; "
                      f"`ratio` = recall / exact's recall; select times are medians per GQA group.\n")
    hdr = ["data", "n", "method", "build s", "select ms", "speed-up vs exact", "recall", "ratio", "oracle recall", "oracle ratio",
           "index B/token", "pages"]
    rows_md = []
    for a in agg_rows:
        ex_t, ex_r = a[f"exact_select_ms@{bmid}"], a[f"exact_recall@{bmid}"]
        rows_md.append([a["data"], int(a["n"]), "exact", a["exact_build_s"], ex_t, 1.0, ex_r, 1.0, float("nan"), float("nan"),
                        a["exact_index_bytes_per_token"], a["exact_pages"]])
        for v in s_variants:
            rows_md.append([a["data"], int(a["n"]), v, a[f"{v}_build_s"], a[f"{v}_select_ms@{bmid}"], ex_t / a[f"{v}_select_ms@{bmid}"],
                            a[f"{v}_recall@{bmid}"], a[f"{v}_recall@{bmid}"] / ex_r, a[f"{v}-oracle_recall@{bmid}"],
                            a[f"{v}-oracle_recall@{bmid}"] / ex_r, a[f"{v}_index_bytes_per_token"], a[f"{v}_pages"]])
        if f"kmeans_recall@{bmid}" in a:
            rows_md.append([a["data"], int(a["n"]), "kmeans", a["kmeans_build_s"], float("nan"), float("nan"),
                            a[f"kmeans_recall@{bmid}"], a[f"kmeans_recall@{bmid}"] / ex_r, float("nan"), float("nan"),
                            float("nan"), a["kmeans_pages"]])
    res.report.append(md_table(hdr, rows_md))


def _scaling_targets(agg_rows: list[dict[str, Any]], s_variants: dict[str, dict[str, Any]], bmid: int, res: BenchResults) -> None:
    for data in ("real", "synthetic"):
        rs = [a for a in agg_rows if a["data"] == data]
        se = slope([a["n"] for a in rs], [a[f"exact_select_ms@{bmid}"] for a in rs])
        for v in s_variants:
            sm = slope([a["n"] for a in rs], [a[f"{v}_select_ms@{bmid}"] for a in rs])
            res.report.append(f"\n{data}, {v}: growth exponent of select time (t ~ n^a, least squares): {sm:.2f} (exact {se:.2f}).")
            at = [a for a in rs if a["n"] == 131072]
            if at:
                a = at[0]
                sp = a[f"exact_select_ms@{bmid}"] / a[f"{v}_select_ms@{bmid}"]
                rr = a[f"{v}_recall@{bmid}"] / a[f"exact_recall@{bmid}"]
                ro = a[f"{v}_recall@{bmid}"] / a[f"{v}-oracle_recall@{bmid}"]
                res.targets.append(f"- {data} 128k, {v}: {sp:.2f}x faster than exact ({'MET' if sp >= 3 else 'MISSED'} >= 3x); recall "
                                   f"{rr:.3f} of exact's ({'MET' if rr >= 0.95 else 'MISSED'} >= 0.95; {ro:.3f} of its own pages' oracle ranking); "
                                   f"select-time exponent {sm:.2f} vs exact {se:.2f}")
        at = [a for a in rs if a["n"] == 131072 and f"kmeans_recall@{bmid}" in a]
        if at:
            a = at[0]
            res.targets.append(f"- {data} 128k, k-means pages (reference, exact page ranking): recall "
                               f"{a[f'kmeans_recall@{bmid}'] / a[f'exact_recall@{bmid}']:.3f} of exact's")


def report_text(res: BenchResults, model: Any, command: str, wall_s: float, mdci_params: dict[str, Any],
                variants: dict[str, tuple[str, dict[str, Any]]]) -> str:
    """The Markdown report: command, wall time, machine and model, the parts' sections, the targets."""
    cfg = model.config
    head = ["# Index benchmark\n", f"Command: `{command}`  ", f"Wall time: {wall_s:.0f} s  ",
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}  ",
            f"Model: {cfg._name_or_path or 'embedded SmolLM2-135M-Instruct'} ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query / "
            f"{cfg.num_key_value_heads} KV heads); "
            f"mdci parameters: {mdci_params or 'defaults (preset wide)'}" + (f"; variants: {', '.join(variants)}" if len(variants) > 1 else "") + "\n"]
    report = list(res.report)
    if res.targets:
        report.append("\n### Targets (issue 3)\n")
        report.extend(res.targets)
    return "\n".join(head) + "\n" + "\n".join(report) + "\n"


def write_results(out: str | Path, res: BenchResults, text: str, budgets: Sequence[int], sizes: Sequence[int],
                  scaling_budgets: str) -> Path:
    """``--out``: every non-empty CSV table, ``bench_index.md``, ``bench_index.png`` and (with ``--pareto`` data)
    ``pareto.png`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in res.csv_out.items():
        if rows:
            write_csv(out / name, rows)
    (out / "bench_index.md").write_text(text)
    plot_results(out / "bench_index.png", res.summary_quality, budgets, res.scaling_rows, sizes,
                 128 if 128 in scaling_budgets.split(",") else int(scaling_budgets.split(",")[0]))
    if "pareto.csv" in res.csv_out:
        plot_pareto(out / "pareto.png", res.csv_out["pareto.csv"], 128 if 128 in budgets else budgets[len(budgets) // 2])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``icecache bench index [options]``: part A (quality and speed on one prompt) and part B (scaling). Bad
    input is one line, no traceback (`run_reporting_errors`)."""
    from icecache.core.errors import run_reporting_errors

    args = parse_args(argv)
    argv = list(argv) if argv is not None else sys.argv[1:]
    return run_reporting_errors(lambda: run_bench(args, argv), prog="icecache bench index")


def run_bench(args: Any, argv: list[str]) -> int:
    """The benchmark of parsed ``args`` (``argv``: the command line, for the report; see `main`)."""
    from icecache.measure.capture import long_text
    from icecache.runtime.models import load_model

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    dense = {int(x) for x in args.dense_layers.split(",") if x}
    mdci_params = dict(args.mdci)
    variants = part_a_variants(args)
    model, tok = load_model(args.model)
    n_layers = model.config.num_hidden_layers
    layers = [int(x) for x in args.layers.split(",")] if args.layers else [layer for layer in range(n_layers) if layer not in dense]
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    ids_all = long_text(tok, max(args.tokens, max(sizes) if not args.no_scaling else 0), args.text)
    res = BenchResults()
    if not args.no_quality:
        run_quality(model, ids_all[:, : args.tokens], args, layers, budgets, variants, res)
    if not args.no_scaling:
        run_scaling(model, ids_all, args, sizes, mdci_params, res)
    cmd = "icecache bench index " + " ".join(shlex.quote(a) for a in argv)
    text = report_text(res, model, cmd, time.perf_counter() - t_start, mdci_params, variants)
    print(text)
    if args.out:
        out = write_results(args.out, res, text, budgets, sizes, args.scaling_budgets)
        print(f"wrote {out}/", file=sys.stderr)
    return 0
