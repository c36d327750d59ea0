"""`IndexWorkers`: which intra-op thread count each kind of background job sees, and that only those threads
change."""

from __future__ import annotations

import threading

import pytest
import torch

from icecache.runtime.workers import IndexWorkers


def _threads_seen(workers: IndexWorkers, kind: str) -> int:
    return int(workers.submit(0, f"{kind} probe", torch.get_num_threads, kind=kind).result())


@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch built without OpenMP")
def test_insert_jobs_run_on_one_intra_op_thread_and_nothing_else_changes() -> None:
    default = torch.get_num_threads()
    workers = IndexWorkers(2)
    try:
        build = _threads_seen(workers, "build")
        insert = _threads_seen(workers, "insert")
        build_again = _threads_seen(workers, "build")  # a later prefill gets fresh build threads
    finally:
        workers.close()
    seen: list[int] = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert insert == 1
    assert build == build_again == default
    assert torch.get_num_threads() == default  # the caller's own count
    assert seen == [default]  # threads started later keep the process default


def test_unknown_job_kind_is_refused() -> None:
    workers = IndexWorkers(1)
    try:
        with pytest.raises(ValueError, match="unknown job kind"):
            workers.submit(0, "probe", int, kind="prefetch")
    finally:
        workers.close()


def test_first_insert_releases_the_build_threads() -> None:
    workers = IndexWorkers(1)
    try:
        workers.submit(0, "build", int).result()
        build_threads = {t for t in threading.enumerate() if t.name.startswith("icecache-build")}
        assert build_threads
        workers.submit(0, "insert", int, kind="insert").result()
        for t in build_threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in build_threads)
    finally:
        workers.close()


@pytest.mark.parametrize("mode, device, torch_threads, cores, expected", [
    ("background", "cpu", 2, 2, True),
    ("inline", "cuda", 1, 8, False),
    ("auto", "cpu", 2, 2, False),  # every core runs the model's ops: a worker would take one from them
    ("auto", "cpu", 1, 2, True),  # a core left free
    ("auto", "cuda", 8, 8, True),  # the decode thread mostly waits for the device
])
def test_insert_mode_policy(monkeypatch, mode, device, torch_threads, cores, expected) -> None:
    import os

    from icecache.runtime.workers import background_inserts

    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert background_inserts(mode, torch.device(device)) is expected
    with pytest.raises(ValueError, match="unknown insert mode"):
        background_inserts("sometimes", torch.device(device))


@pytest.mark.parametrize("inserts", ["inline", "background"])
def test_decode_releases_the_build_threads_and_reports_the_insert_mode(inserts) -> None:
    """The first decode step releases the prefill's build threads even when no insert goes to a worker (with
    them alive, every op of the decode step ran slower); `stats()` says where the inserts ran."""
    from conftest import make_tiny_llama

    from icecache import IceCache, IceCacheConfig
    from icecache.runtime.attention import use_attention

    model = make_tiny_llama(seed=0)
    cache = IceCache(model.config, IceCacheConfig(index="exact", budget=16, page_size=4, window=8, dense_layers=(),
                                                  inserts=inserts, threads=1))
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    try:
        with use_attention(model), torch.no_grad():
            out = model(ids, past_key_values=cache, use_cache=True)
            build_threads = {t for t in threading.enumerate() if t.name.startswith("icecache-build")}
            assert build_threads
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(3):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for t in build_threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in build_threads)
        assert cache.stats()["inserts"] == inserts
        cache.check_conservation()
    finally:
        cache.close()


@pytest.mark.parametrize("index", ["exact", "mdci", "sequential"])
def test_inline_and_background_inserts_decode_the_same_tokens(index) -> None:
    """Where the decode inserts run changes timing only: greedy tokens and logits are the same (the RULER
    runner leaves ``inserts`` out of a run's settings for this reason)."""
    from conftest import make_tiny_llama

    from icecache import IceCache, IceCacheConfig
    from icecache.runtime.attention import use_attention

    model = make_tiny_llama(seed=1)
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    runs = {}
    for inserts in ("inline", "background"):
        cache = IceCache(model.config, IceCacheConfig(index=index, budget=24, page_size=4, window=16, dense_layers=(),
                                                      inserts=inserts))
        tokens, logits = [], []
        try:
            with use_attention(model), torch.no_grad():
                out = model(ids, past_key_values=cache, use_cache=True)
                for _ in range(24):
                    token = out.logits[:, -1:].argmax(-1)
                    tokens.append(int(token))
                    logits.append(out.logits[0, -1])
                    out = model(token, past_key_values=cache, use_cache=True)
            assert cache.stats()["inserts"] == inserts
        finally:
            cache.close()
        runs[inserts] = (tokens, torch.stack(logits))
    assert runs["inline"][0] == runs["background"][0]
    assert torch.equal(runs["inline"][1], runs["background"][1])
