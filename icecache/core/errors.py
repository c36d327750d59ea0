"""The exceptions icecache raises on purpose.

Every error a user can provoke with bad input is one of these (or a subclass of the matching builtin, so
``except ValueError`` keeps working). A broken *internal* invariant raises ``AssertionError`` /
``RuntimeError`` instead: that is our bug, not the caller's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class IceCacheError(Exception):
    """Base class of every documented icecache exception."""


class ConfigError(IceCacheError, ValueError):
    """A configuration value is out of its allowed range (the message names the field and the range)."""


class InputError(IceCacheError, ValueError):
    """A tensor argument has the wrong shape, is empty where it may not be, or holds NaN/inf."""


class InputTypeError(IceCacheError, TypeError):
    """A tensor argument has the wrong type or dtype (we never guess a conversion)."""


class UnknownNameError(IceCacheError, ValueError):
    """An unknown pager, model or hardware name (the message lists the known ones)."""


class ModelLoadError(IceCacheError, RuntimeError):
    """A model could not be located or loaded (the message says how to fix it)."""


class CacheMisuseError(IceCacheError, RuntimeError):
    """An IceCache cache was used in a way it does not support (wrong attention implementation, ...)."""


def run_reporting_errors(action: Callable[[], int | None], prog: str = "icecache") -> int:
    """Run a command-line ``action`` and return its exit code. Our errors (`IceCacheError`) and files that cannot
    be read or written (`OSError`) print one line, ``<prog>: error: <message>``, with no traceback, and return 2;
    Ctrl-C prints ``<prog>: interrupted`` and returns 130. Every ``icecache`` entry point goes through here."""
    try:
        return int(action() or 0)
    except (IceCacheError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
