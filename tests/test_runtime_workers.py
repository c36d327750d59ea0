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
