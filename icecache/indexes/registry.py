"""One registry of pager backends: ``make_pager("mdci", head_dim=64, page_size=16, seed=0)``.

A backend is one module in `icecache.indexes` whose `SemanticPager` subclass is decorated with
``@register_pager("name")``. Modules are discovered on first use, so adding a backend touches one file.
Backends import optional dependencies (faiss, hnswlib, ...) lazily, so discovery never fails on them.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.core.pager import SemanticPager
from icecache.core.spec import parse_spec

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
    package = __name__.rpartition(".")[0]  # the backends' package, icecache.indexes: this module's folder
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name != "registry" and not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
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
    """Create a pager backend by name or spec (``"mdci"``, ``"mdci[search=exhaustive]"``: `icecache.core.spec`).
    ``params`` are the backend's own keyword arguments, on top of the spec's (an unknown one raises
    `ConfigError` listing the backend's parameters)."""
    name, spec_params = parse_spec(name)
    params = {**spec_params, **params}
    cls = get_pager_class(name)
    accepted = inspect.signature(cls.__init__).parameters
    if not any(param.kind is inspect.Parameter.VAR_KEYWORD for param in accepted.values()):  # else the pager checks
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            known = [key for key, param in accepted.items()
                     if key not in ("self", "head_dim", "page_size", "seed") and param.kind is param.KEYWORD_ONLY]
            raise unknown_parameter_error(name, unknown, known)
    return cls(head_dim=head_dim, page_size=page_size, seed=seed, **params)


def unknown_parameter_error(pager: str, unknown: Iterable[str], known: Iterable[str]) -> ConfigError:
    """The one-line `ConfigError` for parameters a pager does not take, listing the ones it does. Pagers that
    take ``**overrides`` (so `make_pager` cannot check their names) raise it themselves."""
    return ConfigError(f"pager {pager!r} has no parameter {', '.join(map(repr, unknown))}; its parameters: {', '.join(known)}")
