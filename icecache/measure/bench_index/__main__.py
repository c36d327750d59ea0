"""``python -m icecache.measure.bench_index [options]`` (the same as ``icecache bench index``)."""

import sys

from icecache.measure.bench_index.cli import main

sys.exit(main())
