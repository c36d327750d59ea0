"""GPU check for the IceCache runtime: equivalence on CUDA, a timed decode, and bulk-copy throughput.

One script, well under 8 minutes on one GPU. CI never runs it; run it when a GPU machine is lent:

    # on the dev machine (the device image has transformers 5.17; our integration targets 5.2):
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
        transformers==5.2.0 simpy==4.1.2
    # device `run`, carry [".whl"]:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 experiments/gpu_check.py --out $OUT

The embedded model's weights do not fit the 64 MiB that travels to the GPU machine, so the timed decode uses
a randomly initialised model with SmolLM2-135M's exact shapes (timing does not depend on the weights), and
equivalence uses the tiny random Llama of the test suite. ``--device cpu`` runs the same checks on the CPU
(small sizes) so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import icecache
from icecache import IceCache, IceCacheConfig
from icecache.measure.capture import left_padded_random_ids
from icecache.runtime.attention import use_attention
from icecache.runtime.loader import BulkLoader
from icecache.runtime.store import HeadStore
from icecache.runtime.timing import StageTimer

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def random_llama(shape: dict, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**shape)).to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate(model, ids, mask, cfg, steps):
    kw = dict(max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        if cfg is None:
            out = model.generate(ids, attention_mask=mask, **kw)
            return out.sequences, torch.stack(out.logits).float(), None
        cache = IceCache(model.config, cfg)
        with use_attention(model):
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
        return out.sequences, torch.stack(out.logits).float(), cache


def check_equivalence(device: str) -> list[dict]:
    """Budget >= context on CUDA reproduces built-in SDPA (batch 1 and left-padded batch 2, fp32 and bf16)."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = random_llama(TINY, device, dtype)
        for batch in (1, 2):
            ids, mask = left_padded_random_ids((100, 70)[:batch], seed=1)
            ids, mask = ids.to(device), mask.to(device)
            ref_seq, ref_logits, _ = generate(model, ids, mask, None, 32)
            for index in icecache.available_pagers():
                cfg = IceCacheConfig(index=index, budget=512, page_size=8, sink=4, window=16, dense_layers=())
                seq, logits, cache = generate(model, ids, mask, cfg, 32)
                cache.check_conservation()
                cache.close()
                rows.append({"check": "equivalence", "dtype": str(dtype).split(".")[-1], "batch": batch, "index": index,
                             "max_abs_dlogit": float((logits - ref_logits).abs().max()),
                             "tokens_equal": bool(torch.equal(seq, ref_seq))})
    return rows


def timed_decode(device: str, contexts: list[int], steps: int) -> list[dict]:
    """TPOT of full attention vs IceCache on a random model with SmolLM2-135M's shapes."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = random_llama(SMOLLM2, device, dtype)
    rows = []
    for n in contexts:
        ids = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        mask = torch.ones_like(ids)
        variants = [("full", None)] + [
            (f"icecache-{ix}@{b}", IceCacheConfig(index=ix, budget=b)) for ix in ("mdci", "sequential") for b in (64, 256)
            if ix in icecache.available_pagers()
        ]
        for name, cfg in variants:
            cache = IceCache(model.config, cfg) if cfg is not None else None
            ctx = use_attention(model) if cfg is not None else _nullcontext()
            with torch.no_grad(), ctx:
                sync(device)
                t0 = time.perf_counter()
                out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                sync(device)
                ttft = time.perf_counter() - t0
                pkv = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                times = []
                for _ in range(steps):
                    sync(device)
                    t1 = time.perf_counter()
                    out = model(nxt, past_key_values=pkv, use_cache=True)
                    nxt = out.logits[:, -1:].argmax(-1)
                    sync(device)
                    times.append(time.perf_counter() - t1)
            tpot = sorted(times[2:])[len(times[2:]) // 2] if len(times) > 3 else sum(times) / len(times)
            row = {"check": "decode", "context": n, "variant": name, "prefill_s": ttft, "tpot_ms_median": 1000 * tpot}
            if cache is not None:
                st = cache.stats()
                row.update(device_kv_mib=st["device_kv_bytes"] / 2**20, full_kv_mib=st["full_kv_bytes"] / 2**20,
                           copies_per_layer_step=st["copies_per_layer_step"],
                           stage_ms={k: 1000 * v / max(st["steps"], 1) for k, v in st["stage_seconds"].items()})
                cache.close()
            rows.append(row)
    return rows


def bulk_copy(device: str, pages_per_head: int = 16, heads: int = 84, P: int = 16, D: int = 64, repeats: int = 20) -> list[dict]:
    """BulkLoader gather + one copy + scatter for one decode step's worth of pages, vs one large pinned copy."""
    from icecache.core.pages import PageTable

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    budget = pages_per_head * P
    stores = []
    g = torch.Generator().manual_seed(0)
    n = 8192
    for _ in range(heads):
        t = PageTable(P, record_moves=True)
        t.new_pages([list(range(i, i + P)) for i in range(0, n, P)])
        s = HeadStore(t, D, dtype, pin=device.startswith("cuda"))
        kv = torch.randn(n, D, generator=g).to(dtype)
        s.sync(t.take_moves(), kv, kv)
        stores.append(s)
    buf_k = torch.zeros(1, heads, budget, D, dtype=dtype, device=device)
    buf_v = torch.zeros_like(buf_k)
    valid = torch.zeros(1, heads, budget, dtype=torch.bool, device=device)
    loader = BulkLoader(buf_k, buf_v, valid, 0, budget)
    timer = StageTimer()
    total = 0.0
    nbytes = 0
    for _ in range(repeats):  # fresh pages every step: nothing is resident, everything is copied
        pos = [[torch.randperm(n // P, generator=g)[:pages_per_head].repeat_interleave(P).mul(P).add(torch.arange(P).repeat(pages_per_head)).numpy()
                for _ in range(heads)]]
        loader.slot_pos[:] = -1
        for row in loader._slot_of_pos:
            for a in row:
                a[:] = -1
        sync(device)
        t0 = time.perf_counter()
        rep = loader.load([stores], pos, [[None] * heads], timer)
        sync(device)
        total += time.perf_counter() - t0
        nbytes = rep.bytes_copied
    one = torch.empty(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, pin_memory=device.startswith("cuda"))
    dst = torch.empty_like(one, device=device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(one, non_blocking=True)
    sync(device)
    big = (time.perf_counter() - t0) / repeats
    step = total / repeats
    return [{"check": "bulk_copy", "bytes_per_step": nbytes, "loader_ms": 1000 * step, "loader_GBps": nbytes / step / 1e9,
             "one_copy_ms": 1000 * big, "one_copy_GBps": nbytes / big / 1e9,
             "stage_ms": {k: 1000 * v / repeats for k, v in timer.seconds.items() if v}}]


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default=None, help="comma-separated prompt lengths for the timed decode")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=None, help="directory for gpu_check.json")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else ([2048, 8192, 32768] if cuda else [1024])
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    import transformers

    info["transformers"] = transformers.__version__
    print(json.dumps(info))
    t0 = time.perf_counter()
    rows = check_equivalence(args.device)
    rows += timed_decode(args.device, contexts, args.steps)
    rows += bulk_copy(args.device, repeats=20 if cuda else 3, heads=84 if cuda else 12)
    print("\n| check | detail | value |\n|---|---|---|")
    for r in rows:
        if r["check"] == "equivalence":
            print(f"| equivalence | {r['dtype']} batch {r['batch']} {r['index']} | max dlogit {r['max_abs_dlogit']:.2e}, tokens equal {r['tokens_equal']} |")
        elif r["check"] == "decode":
            extra = f", device KV {r['device_kv_mib']:.1f} / {r['full_kv_mib']:.1f} MiB" if "device_kv_mib" in r else ""
            print(f"| decode | {r['context']} tokens, {r['variant']} | TPOT {r['tpot_ms_median']:.2f} ms, prefill {r['prefill_s']:.2f} s{extra} |")
        else:
            print(f"| bulk copy | {r['bytes_per_step'] / 2**20:.2f} MiB per step | loader {r['loader_GBps']:.2f} GB/s ({r['loader_ms']:.2f} ms) vs one copy {r['one_copy_GBps']:.2f} GB/s |")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2))
    bad = [r for r in rows if r["check"] == "equivalence" and r["dtype"] == "float32" and r["max_abs_dlogit"] > 1e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
