"""In-step A/B of M-DCI's compiled level-0 insert (`icecache.indexes.dci_update._leaf_fast_path`) against the
general Python path, in one process on one cache: SmolLM2 prefills a pydoc prompt once, then rounds of
16-step decode blocks alternate the two paths (order flipped every round). Both paths make the same edits
(`tests/test_mdci.py::test_compiled_leaf_insert_makes_the_general_paths_edits`), so the cache evolves the same.

    python experiments/bench_runtime/leaf_insert_ab/ab.py --context 8000 --rounds 8 --out experiments/bench_runtime/leaf_insert_ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from icecache import IceCache, IceCacheConfig
from icecache.eval.tasks import text_window
from icecache.indexes import dci_update
from icecache.runtime.attention import use_attention
from icecache.runtime.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    model, tok = load_model()
    ids = torch.tensor([text_window(tok, args.context, seed=0)])
    cache = IceCache(model.config, IceCacheConfig(index="mdci", budget=256))
    compiled = dci_update._leaf_fast_path
    paths = {"compiled": compiled, "python": lambda *a: False}
    insert_ms: dict[str, list[float]] = {name: [] for name in paths}
    step_ms: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode(), use_attention(model):
        tok_id = model(ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
        for _ in range(5):
            tok_id = model(tok_id, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
        try:
            for rnd in range(args.rounds):
                for name in list(paths) if rnd % 2 == 0 else list(paths)[::-1]:
                    dci_update._leaf_fast_path = paths[name]
                    before = cache.stats()["stage_seconds"]["insert"]
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        tok_id = model(tok_id, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
                    step_ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
                    insert_ms[name].append((cache.stats()["stage_seconds"]["insert"] - before) / args.steps * 1e3)
        finally:
            dci_update._leaf_fast_path = compiled
    wall = time.perf_counter() - t_start
    result = {"context": args.context, "rounds": args.rounds, "steps": args.steps, "wall_s": round(wall, 1),
              "insert_ms": insert_ms, "step_ms": step_ms}
    lines = [f"Command: `python experiments/bench_runtime/leaf_insert_ab/ab.py {' '.join(sys.argv[1:])}`", "",
             f"SmolLM2, M-DCI@256, context {args.context}, {args.rounds} rounds x {args.steps} decode steps per path; "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; wall {wall:.0f} s.", "",
             "| path | insert ms per step (median) | step ms (median) | insert per round |", "|---|---|---|---|"]
    for name in paths:
        lines.append(f"| {name} | {statistics.median(insert_ms[name]):.2f} | {statistics.median(step_ms[name]):.1f} | "
                     + " ".join(f"{x:.1f}" for x in insert_ms[name]) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab.md").write_text(text)
        (out / "ab.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
