"""Pager backends (one module each) behind one registry: `make_pager(name, head_dim=..., page_size=...)`."""

from icecache.indexes.registry import available_pagers, get_pager_class, make_pager, register_pager

__all__ = ["make_pager", "register_pager", "available_pagers", "get_pager_class"]
