"""The exceptions icecache raises on purpose.

Every error a user can provoke with bad input is one of these (or a subclass of the matching builtin, so
``except ValueError`` keeps working). A broken *internal* invariant raises ``AssertionError`` /
``RuntimeError`` instead: that is our bug, not the caller's.
"""

from __future__ import annotations


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
