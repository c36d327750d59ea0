"""``python -m icecache.sim ...``: see `icecache.sim.cli`."""

import sys

from icecache.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
