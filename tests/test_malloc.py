"""`icecache.runtime.malloc`: the glibc mmap-threshold pin the runtime applies for long generations."""

from __future__ import annotations

import platform

import pytest

from icecache.runtime import malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


@glibc
def test_pin_applies_once_and_reports(monkeypatch):
    monkeypatch.delenv("ICECACHE_KEEP_MALLOC", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert malloc.pin_mmap_threshold() is True
    assert malloc.pinned_threshold() == malloc.DEFAULT_THRESHOLD
    assert malloc.pin_mmap_threshold() is True  # idempotent


def test_opt_outs_leave_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(malloc, "_applied", None)
    monkeypatch.setenv("ICECACHE_KEEP_MALLOC", "1")
    assert malloc.pin_mmap_threshold(1 << 20) is False and malloc.pinned_threshold() is None
    monkeypatch.delenv("ICECACHE_KEEP_MALLOC")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own setting wins
    assert malloc.pin_mmap_threshold(1 << 20) is False and malloc.pinned_threshold() is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "128k"])
def test_bad_threshold_is_refused(bad):
    with pytest.raises(ValueError):
        malloc.pin_mmap_threshold(bad)


@glibc
def test_icecache_pins_it(monkeypatch):
    from icecache import IceCache, IceCacheConfig
    from conftest import make_tiny_llama

    monkeypatch.delenv("ICECACHE_KEEP_MALLOC", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(malloc, "_applied", None)
    model = make_tiny_llama(seed=0)
    IceCache(model.config, IceCacheConfig(budget=16, page_size=4, window=8)).close()
    assert malloc.pinned_threshold() == malloc.DEFAULT_THRESHOLD
