"""Cost of ``heap_policy="pin"`` for index work (issue 8; ../reliability.md): 24 M-DCI builds of 8k random keys
(d = 64) and 300 one-token inserts, in a fresh process with or without glibc's mmap threshold pinned.

    python experiments/reliability/pin_cost.py        # glibc as it is
    python experiments/reliability/pin_cost.py pin    # threshold fixed at 128 KiB first

Run each a few times, alternating, alone on the machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from icecache.indexes import make_pager
from icecache.runtime.malloc import pin_mmap_threshold


def main() -> None:
    pinned = len(sys.argv) > 1 and sys.argv[1] == "pin"
    if pinned and not pin_mmap_threshold(force=True):
        raise SystemExit("could not pin the mmap threshold (not glibc?)")
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(8000, 64, generator=g) for _ in range(24)]
    make_pager("mdci", 64, 16, 0).build(keys[0])  # JIT warm-up
    t0 = time.perf_counter()
    pagers = []
    for k in keys:
        p = make_pager("mdci", 64, 16, 0)
        p.build(k)
        pagers.append(p)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(300):
        pagers[i % 24].insert(torch.randn(1, 64, generator=g), check=False)
    insert_s = time.perf_counter() - t0
    print(f"{'pinned' if pinned else 'default'}: build 24 x 8k keys {build_s:.2f} s; 300 inserts {insert_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
