"""``icecache bench index``: page-selection quality and speed of the pagers on real keys and queries.

Part A (quality, one 8k-token prompt). Real post-RoPE keys, values and queries of the embedded model on long
real text (`icecache.measure.capture`). The queries of the last ``--steps`` positions act as decode-step
queries against the keys before them: the pagers are built on the *middle* (everything but the ``--sink``
first and the ``--window`` most recent tokens) of the first step, and at every later step the token leaving
the window is inserted, as during decoding. For every non-dense layer and KV head (GQA group of query heads)
and budget, each method selects pages; we report hit rate, attention recall and output error
(`icecache.core.metrics`), build time per head and query time per decode step (all sparse layers and KV
heads). Methods: ``exact`` (oracle top tokens), ``sequential`` (Quest pages), ``mdci``, ``mdci-oracle`` (mdci's
pages ranked by their exact best token: page formation without search error) and ``kmeans`` (a
capacity-constrained k-means clustering of the keys into as many pages as mdci, each at most the page size,
pages ranked by their exact best token: a quality reference for semantic paging).

Part B (scaling). Keys of ``n`` = 8k .. 256k tokens per KV head: captures of consecutive 8k windows of long
real text concatenated, each window with RoPE positions continuing the previous one (attention inside a
window is unchanged by the offset, so the keys are those of one long context); queries = the last positions
of the last window. Plus a synthetic clustered set. ``mdci`` vs ``exact``: select time per GQA group, attention
recall, index bytes per token next to the KV bytes per token.

Results: a Markdown table on stdout; ``--out DIR`` writes CSV files, ``bench_index.md`` (with the command and
wall time) and ``bench_index.png``.

Modules: `references` (oracle page ranking, k-means pages), `quality` (part A per head), `scaling` (part B per
point), `plots`, `cli` (the command: `main`).
"""

from icecache.measure.bench_index.cli import DEFAULT_SIZES, build_parser, main, parse_variant
from icecache.measure.bench_index.quality import PARETO_SWEEP, HeadResult, StepMetrics, evaluate_head
from icecache.measure.bench_index.references import KMeansPages, kmeans_groups, oracle_rank
from icecache.measure.bench_index.scaling import scaling_point, synthetic_clustered

__all__ = [
    "DEFAULT_SIZES", "build_parser", "main", "parse_variant",
    "PARETO_SWEEP", "HeadResult", "StepMetrics", "evaluate_head",
    "KMeansPages", "kmeans_groups", "oracle_rank",
    "scaling_point", "synthetic_clustered",
]
