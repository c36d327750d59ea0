"""Does every path the write-ups cite exist? (issue 21: every README claim links to the folder holding its run)

Checks, in the top-level README.md and every Markdown file under experiments/:

1. every mention of a path ``experiments/...`` (what
   ``grep -rhoE "experiments/[A-Za-z0-9_./-]+" README.md experiments --include=*.md`` finds), with shell braces
   expanded (``soak_tiny_{sync,bg}_topk``) and ``*`` globbed; a trailing ``.`` ends the sentence, not the path.
   A path given as a command's ``--out`` may be a prefix of the files the command wrote (``--out
   experiments/sim/gemma_projection`` writes ``gemma_projection.{md,csv,png}``);
2. every relative Markdown link ``[text](target)``, resolved from the file's folder, and for a ``.md`` target
   with ``#anchor`` that a heading of that file has that anchor (GitHub's rule: lower case, punctuation
   dropped, spaces as hyphens).

Prints one line per missing path or link and exits 1; otherwise prints how much it checked and exits 0.

    python experiments/check_links.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MENTION = re.compile(r"(--out\s+)?(experiments/(?:[A-Za-z0-9_./*-]|\{[A-Za-z0-9_.,-]*\})+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def expand_braces(p: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return [q for alt in m.group(1).split(",") for q in expand_braces(p[: m.start()] + alt + p[m.end():])]


#: Files that moved out of experiments/ into the package (issue 21: the library reads no experiments/ file).
#: Run records keep the path their command used; it counts as present when the file is at its new place.
MOVED = {
    "experiments/sim/profile_this_machine.json": "icecache/sim/data/profile_this_machine.json",
    "experiments/sim/measured_runs.jsonl": "icecache/sim/data/measured_runs.jsonl",
}


def exists(p: str, out_prefix: bool) -> bool:
    p = p.rstrip(".").rstrip("/") or "."
    p = MOVED.get(p, p)
    if "*" in p:
        return any(ROOT.glob(p))
    if (ROOT / p).exists():
        return True
    return out_prefix and any((ROOT / p).parent.glob((ROOT / p).name + ".*"))


def slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def main() -> int:
    files = [ROOT / "README.md", *sorted((ROOT / "experiments").rglob("*.md"))]
    missing, n_paths, n_links = [], 0, 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        rel = f.relative_to(ROOT)
        for out, raw in MENTION.findall(text):
            for p in expand_braces(raw):
                n_paths += 1
                if not exists(p, bool(out)):
                    missing.append(f"missing path: {rel}: {p}")
        for target in LINK.findall(FENCE.sub("", text)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            n_links += 1
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve()
            if not dest.exists():
                missing.append(f"missing link: {rel}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                missing.append(f"missing anchor: {rel}: {target}")
    for m in missing:
        print(m)
    if missing:
        return 1
    print(f"{len(files)} Markdown files: {n_paths} experiments/ path mentions and {n_links} relative links, all exist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
