"""Core building blocks: configuration, the pager interface, the page table, transforms and metrics."""

from icecache.core.config import IceCacheConfig
from icecache.core.errors import (
    CacheMisuseError,
    ConfigError,
    IceCacheError,
    InputError,
    InputTypeError,
    ModelLoadError,
    UnknownNameError,
)
from icecache.core.pager import PageSelection, SemanticPager
from icecache.core.pages import Move, PageTable

__all__ = [
    "IceCacheConfig",
    "PageSelection",
    "SemanticPager",
    "PageTable",
    "Move",
    "IceCacheError",
    "ConfigError",
    "InputError",
    "InputTypeError",
    "ModelLoadError",
    "UnknownNameError",
    "CacheMisuseError",
]
