"""`icecache.runtime.malloc` and `IceCacheConfig.heap_policy`: glibc heap settings for long generations."""

from __future__ import annotations

import platform

import pytest

from icecache.core.errors import ConfigError
from icecache.runtime import malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


@glibc
def test_pin_applies_once_and_reports(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(malloc, "_applied", None)
    assert malloc.pin_mmap_threshold() is True
    assert malloc.pinned_threshold() == malloc.DEFAULT_THRESHOLD
    assert malloc.pin_mmap_threshold() is True  # idempotent


def test_the_users_own_threshold_wins(monkeypatch):
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert malloc.pin_mmap_threshold(1 << 20) is False and malloc.pinned_threshold() is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "128k"])
def test_bad_threshold_is_refused(bad):
    with pytest.raises(ValueError):
        malloc.pin_mmap_threshold(bad)


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@glibc
def test_trim_heap_returns_free_heap_memory_to_the_system():
    """96 MiB of 48 KiB blocks (below the mmap threshold: heap memory), then one small block above them so glibc
    cannot shrink the heap's top when they are freed. The freed memory stays resident until `trim_heap`, which
    must hand most of it back (RSS drops by at least half of it) and say so."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    malloc.trim_heap()
    block, count = 48 << 10, 2048
    blocks = [libc.malloc(block) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, block)  # touch every page
    pin = libc.malloc(block)  # carved from the top of the heap, above every block
    for b in blocks:
        libc.free(b)
    before = _rss_bytes()
    assert malloc.trim_heap() is True
    released = before - _rss_bytes()
    libc.free(pin)
    assert released >= (block * count) // 2, f"trim_heap released {released >> 20} MiB of {block * count >> 20} MiB"


def test_bad_heap_policy_is_refused():
    from icecache import IceCacheConfig

    with pytest.raises(ConfigError, match="heap_policy"):
        IceCacheConfig(heap_policy="jemalloc")


@glibc
@pytest.mark.parametrize("policy", ["trim", "pin", "none"])
def test_icecache_applies_its_heap_policy(policy, monkeypatch):
    import torch
    from conftest import make_tiny_llama

    import icecache.runtime.cache as cache_mod
    from icecache import IceCache, IceCacheConfig
    from icecache.runtime.attention import use_attention

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(malloc, "_applied", None)
    trims: list[int] = []
    monkeypatch.setattr(cache_mod, "trim_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(cache_mod, "TRIM_EVERY", 4)
    model = make_tiny_llama(seed=0)
    cache = IceCache(model.config, IceCacheConfig(budget=16, page_size=4, window=8, heap_policy=policy))
    with torch.inference_mode(), use_attention(model):
        out = model(torch.randint(3, 100, (1, 40)), past_key_values=cache, use_cache=True)
        tok = out.logits[0, -1].argmax().view(1, 1)
        for _ in range(9):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[0, -1].argmax().view(1, 1)
    cache.close()
    assert len(trims) == (2 if policy == "trim" else 0)  # steps 4 and 8
    assert malloc.pinned_threshold() == (malloc.DEFAULT_THRESHOLD if policy == "pin" else None)
