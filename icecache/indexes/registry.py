"""One registry of pager backends: ``make_pager("mdci", head_dim=64, page_size=16, seed=0)``.

A backend is one module in `icecache.indexes` whose `SemanticPager` subclass is decorated with
``@register_pager("name")``. Modules are discovered on first use, so adding a backend touches one file.
Backends import optional dependencies (faiss, hnswlib, ...) lazily, so discovery never fails on them.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Callable, TypeVar

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.core.pager import SemanticPager

_REGISTRY: dict[str, type[SemanticPager]] = {}
_discovered = False
P = TypeVar("P", bound=type[SemanticPager])


def register_pager(name: str) -> Callable[[P], P]:
    """Class decorator: register a `SemanticPager` subclass under ``name`` (duplicates raise)."""

    def deco(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, SemanticPager)):
            raise TypeError(f"@register_pager({name!r}) needs a SemanticPager subclass, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"pager name {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    import icecache.indexes as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "registry" and not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    _discovered = True


def available_pagers() -> list[str]:
    """Registered pager names, sorted."""
    _discover()
    return sorted(_REGISTRY)


def get_pager_class(name: str) -> type[SemanticPager]:
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError(f"unknown pager {name!r}; known pagers: {', '.join(sorted(_REGISTRY))}") from None


def make_pager(name: str, head_dim: int, page_size: int = 16, seed: int = 0, **params: Any) -> SemanticPager:
    """Create a pager backend by name. ``params`` are the backend's own keyword arguments (an unknown one raises
    `ConfigError` listing the backend's parameters)."""
    cls = get_pager_class(name)
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            known = [k for k, p in accepted.items() if k not in ("self", "head_dim", "page_size", "seed") and p.kind is p.KEYWORD_ONLY]
            raise ConfigError(f"pager {name!r} has no parameter {', '.join(map(repr, unknown))}; its parameters: {', '.join(known)}")
    return cls(head_dim=head_dim, page_size=page_size, seed=seed, **params)
