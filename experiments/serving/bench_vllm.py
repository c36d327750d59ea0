"""Decode speed of vLLM's CPU backend with and without IceCache, and of icecache's HF runtime, in one run.

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
        .venv-serve/bin/python experiments/serving/bench_vllm.py --out experiments/serving/speed_<date>

(run from the checkout root with the serve venv; it starts its vLLM engines from a scratch directory so that the
installed plugin, not the checkout's folder, is imported by them.) One process holds three vLLM engines, each in
its own engine-core and worker processes: vLLM's own CPU backend (plugin not loaded, ``VLLM_PLUGINS=none``) and
the plugin at budget 256 with the exact and the M-DCI pager. Per (context, batch) row the engines take turns:

- a warm-up request of 2 tokens puts the row's prompts into the engine's prefix cache (the prefill is paid
  once and not timed);
- then ``--reps`` rounds of (``--short`` tokens, ``--long`` tokens) per engine, greedy, ``ignore_eos``.

Per request, vLLM's own metrics give the engine-core times of its first and last token; decode time
d(n) = last - first. The steady step time is TPOT = (d(long) - d(short)) / (long - short), which cancels
the first decode step's extra work (the plugin builds its pagers there) and the prefill; that extra work is
reported as ``first_step_extra_s`` = d(short) - (short - 1) * TPOT. Decode throughput = batch / TPOT.
Where the plugin's time goes: save the run's output and ``--stages LOG`` writes OUT/stages.md from the plugin's
per-request log lines.

At batch 1 the same row is also timed in icecache's HF runtime (main venv, ``experiments/tpot_interleaved.py``:
full attention and the same two configs, interleaved blocks of decode steps) in a subprocess, with the same
number of OpenMP threads as vLLM's worker. Prompts: RULER's essay text cut to the context (distinct starts per
batch row); the HF runtime's script uses its own text (Python's docs), which does not change a step's work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {
    "dense": None,
    "icecache exact@256": {"budget": 256, "index": "exact"},
    "icecache mdci@256": {"budget": 256, "index": "mdci"},
}
ROWS = ((4096, 1), (4096, 4), (8000, 1), (8000, 4))


def make_engine(config: dict | None):
    from vllm import LLM

    os.environ["VLLM_PLUGINS"] = "none" if config is None else "icecache"  # read by the engine's processes
    extra = {} if config is None else {"additional_config": {"icecache": config}}
    return LLM(model=str(model_dir()), dtype="float32", max_model_len=8192, enforce_eager=True, seed=0,
               disable_log_stats=False, **extra)


def model_dir() -> Path:
    from icecache.serving.model_dir import vllm_model_dir

    return vllm_model_dir()


def decode_seconds(llm, prompts: list[list[int]], n: int) -> list[float]:
    """Greedy ``n`` tokens for every prompt in one batch; per request, engine time from first to last token."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    res = []
    for o in outs:
        m = o.metrics
        if m is None or not m.first_token_ts or len(o.outputs[0].token_ids) != n:
            raise SystemExit("vLLM returned no per-request metrics (disable_log_stats must be False)")
        res.append(m.last_token_ts - m.first_token_ts)
    return res


def hf_row(context: int, threads: int, reps: int) -> dict:
    """icecache's HF runtime at batch 1: `tpot_interleaved.py` in the main venv, ``threads`` OpenMP threads."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_vllm_hf_{context}"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "experiments" / "tpot_interleaved.py"),
           "--context", str(context), "--variants", "exact@256,mdci@256", "--steps", "16", "--reps", str(reps),
           "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    res = json.loads((out / "tpot_interleaved.json").read_text())
    return {name: round(v["median_step_ms"], 1) for name, v in res["variants"].items()}


STAGE_LINE = re.compile(r"\(Worker pid=(\d+)\).*freed the pagers of request (\S+) \(\w+\).*it took (\d+) layer-steps: "
                        r"build ([\d.]+) s, insert ([\d.]+) s, select ([\d.]+) s, gather ([\d.]+) s, attend ([\d.]+) s")


def stage_table(log: str) -> str:
    """Where the plugin's sparse decode time goes, from the engines' log lines (`RequestState.stage_summary`):
    per engine and context, ms per decode step (28 sparse layers) of each stage, and the build per request."""
    index = dict(re.findall(r"\(Worker pid=(\d+)\).*icecache: sparse decode on: .*index='(\w+)'", log))
    context = {rid: int(n) for rid, n in re.findall(r"request (\S+) decodes sparse from context (\d+)", log)}
    acc: dict[tuple[str, str], list[float]] = {}
    for m in STAGE_LINE.finditer(log):
        pid, rid = m.group(1), m.group(2)
        key = (index.get(pid, pid), "4k" if context[rid] < 6000 else "8k")
        a = acc.setdefault(key, [0.0] * 7)
        a[0] += 1
        a[1] += int(m.group(3))
        for i in range(5):
            a[2 + i] += float(m.group(4 + i))
    lines = ["| pager | context | requests | insert ms/step | select ms/step | gather ms/step | attend ms/step | build s/request |",
             "|---|---|---|---|---|---|---|---|"]
    for (pager, ctx), a in sorted(acc.items()):
        per_step = [1e3 * a[2 + i] / a[1] * 28 for i in (1, 2, 3, 4)]
        lines.append(f"| {pager} | {ctx} | {int(a[0])} | " + " | ".join(f"{x:.1f}" for x in per_step) + f" | {a[2] / a[0]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for speed.json and speed.md")
    ap.add_argument("--stages", metavar="LOG", help="only write OUT/stages.md from a saved log of a run (its stdout)")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kv-space-gib", type=int, default=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")),
                    help="KV cache per engine (GiB); 2 holds the 4 x 8k prompts")
    ap.add_argument("--hf-threads", type=int, default=1,
                    help="OpenMP threads of the HF runtime rows (vLLM binds its worker to 1 core of this 2-core box)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF runtime rows")
    args = ap.parse_args()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.stages:
        (out_dir / "stages.md").write_text(stage_table(Path(args.stages).read_text(errors="replace")))
        print((out_dir / "stages.md").read_text())
        return 0
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_vllm_cwd"
    scratch.mkdir(exist_ok=True)
    os.chdir(scratch)  # as vLLM users run it: not from a directory that holds an icecache/ folder

    from icecache.eval.ruler.haystack import essay_sentences

    t_start = time.perf_counter()
    engines = {name: make_engine(cfg) for name, cfg in ENGINES.items()}
    tok = next(iter(engines.values())).get_tokenizer()
    text_ids = tok(" ".join(essay_sentences(12000)), add_special_tokens=False)["input_ids"]
    rows = []
    for context, batch in ROWS:
        prompts = [text_ids[150 * b : 150 * b + context] for b in range(batch)]
        d: dict[str, dict[int, list[float]]] = {name: {args.short: [], args.long: []} for name in engines}
        for name, llm in engines.items():
            t0 = time.perf_counter()
            decode_seconds(llm, prompts, 2)
            print(f"{context} x {batch} {name}: prefilled (warm-up) in {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.reps):
            for name, llm in engines.items():
                for n in (args.short, args.long):
                    d[name][n].extend(decode_seconds(llm, prompts, n))
        for name in engines:
            short, long_ = statistics.median(d[name][args.short]), statistics.median(d[name][args.long])
            tpot = (long_ - short) / (args.long - args.short)
            rows.append({"engine": name, "context": context, "batch": batch, "tpot_ms": round(1e3 * tpot, 1),
                         "decode_tokens_per_s": round(batch / tpot, 1),
                         "first_step_extra_s": round(short - (args.short - 1) * tpot, 3),
                         "d_short_s": d[name][args.short], "d_long_s": d[name][args.long]})
            print({k: v for k, v in rows[-1].items() if not k.startswith("d_")}, flush=True)
    threads = args.hf_threads
    hf = {} if args.no_hf else {context: hf_row(context, threads, args.reps * 2) for context, batch in ROWS if batch == 1}
    res = {"command": "experiments/serving/bench_vllm.py " + " ".join(sys.argv[1:]), "short": args.short, "long": args.long,
           "reps": args.reps, "rows": rows, "hf_runtime_step_ms": hf, "hf_threads": threads,
           "wall_s": round(time.perf_counter() - t_start)}
    (out_dir / "speed.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["| engine | context | batch | TPOT ms | decode tokens/s | first decode step extra s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['context']} | {r['batch']} | {r['tpot_ms']} | {r['decode_tokens_per_s']} | {r['first_step_extra_s']} |"
              for r in rows]
    if hf:
        lines += ["", f"icecache HF runtime, batch 1, {threads} thread(s), median step ms:", "",
                  "| context | full | exact@256 | mdci@256 |", "|---|---|---|---|"]
        lines += [f"| {c} | {v.get('full')} | {v.get('exact@256')} | {v.get('mdci@256')} |" for c, v in hf.items()]
    (out_dir / "speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
