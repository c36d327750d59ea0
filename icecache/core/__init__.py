"""Core building blocks: configuration, the pager interface, the page table, transforms and metrics.

The names below are imported from their modules on first use, so importing a light module of this package
(``icecache.core.errors``, ``icecache.core.config``) loads neither torch nor numba.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from icecache.core.lazy import lazy_exports

_LAZY = {
    "IceCacheConfig": "icecache.core.config",
    "PageSelection": "icecache.core.pager",
    "SemanticPager": "icecache.core.pager",
    "PageTable": "icecache.core.pages",
    "Move": "icecache.core.pages",
    **{name: "icecache.core.errors" for name in (
        "IceCacheError", "ConfigError", "InputError", "InputTypeError", "ModelLoadError", "UnknownNameError",
        "CacheMisuseError")},
}

__all__ = list(_LAZY)

if TYPE_CHECKING:
    from icecache.core.config import IceCacheConfig as IceCacheConfig
    from icecache.core.errors import CacheMisuseError as CacheMisuseError
    from icecache.core.errors import ConfigError as ConfigError
    from icecache.core.errors import IceCacheError as IceCacheError
    from icecache.core.errors import InputError as InputError
    from icecache.core.errors import InputTypeError as InputTypeError
    from icecache.core.errors import ModelLoadError as ModelLoadError
    from icecache.core.errors import UnknownNameError as UnknownNameError
    from icecache.core.pager import PageSelection as PageSelection
    from icecache.core.pager import SemanticPager as SemanticPager
    from icecache.core.pages import Move as Move
    from icecache.core.pages import PageTable as PageTable


__getattr__, __dir__ = lazy_exports("icecache.core", _LAZY, globals())
