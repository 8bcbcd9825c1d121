"""Recycled gather outputs: a block is reused only after every view of it is gone, and a
recycled output is indistinguishable from a fresh one."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from quiver.feature import Feature
from quiver.feature.buffers import BufferPool

MIB = 1 << 20


def test_block_returns_only_when_the_last_view_dies():
    pool = BufferPool(min_bytes=MIB)
    t = pool.empty((1000, 300), torch.float32)  # 1.2 MB -> a 2 MiB block
    assert t.shape == (1000, 300) and t.dtype == torch.float32 and t.is_contiguous()
    assert pool.allocated == 1 and pool.free_bytes == 0
    view = t[10:20]
    arr = t.numpy()
    del t
    gc.collect()
    assert pool.free_bytes == 0  # a view and a numpy array still use the memory
    del view
    gc.collect()
    assert pool.free_bytes == 0
    arr[:] = 1.0  # still writable, still ours
    del arr
    gc.collect()
    assert pool.free_bytes == 2 * MIB
    again = pool.empty((900, 300), torch.float32)
    assert pool.reused == 1 and pool.allocated == 1 and pool.free_bytes == 0
    assert again.shape == (900, 300)


def test_live_buffers_never_alias():
    pool = BufferPool(min_bytes=MIB)
    live = [pool.empty((512, 1024), torch.float32) for _ in range(4)]
    for i, t in enumerate(live):
        t.fill_(float(i))
    for i, t in enumerate(live):
        assert torch.all(t == float(i))
    ptrs = {t.data_ptr() for t in live}
    assert len(ptrs) == 4


def test_small_requests_and_other_dtypes():
    pool = BufferPool(min_bytes=MIB)
    small = pool.empty((10, 10), torch.float32)
    assert small.shape == (10, 10) and pool.allocated == 0
    b = pool.empty((1024, 1024), torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b.shape == (1024, 1024) and pool.allocated == 1


def test_capacity_bound_drops_extra_blocks():
    pool = BufferPool(max_bytes=2 * MIB, min_bytes=MIB)
    a, b = pool.empty((MIB,), torch.uint8), pool.empty((MIB,), torch.uint8)  # 1 MiB blocks
    c = pool.empty((MIB + 1,), torch.uint8)  # a 2 MiB block
    del a, b, c
    gc.collect()
    # bounded above by max_bytes, and it does keep what fits (two 1 MiB blocks, or the
    # 2 MiB one): a pool that keeps nothing fails here
    assert pool.free_bytes == 2 * MIB
    again = pool.empty((MIB,), torch.uint8)
    assert pool.free_bytes == MIB  # served from a kept block
    del again
    with pytest.raises(ValueError):
        BufferPool(max_bytes=-1)


def test_feature_gathers_recycle_and_stay_exact():
    n, dim = 5000, 64  # 4,000 rows x 256 B = 1 MB per gather
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    feat = Feature().from_cpu_tensor(x)
    rng = np.random.default_rng(0)
    kept = []
    for i in range(6):
        ids = torch.from_numpy(rng.integers(0, n, 4100))
        rows = feat[ids]
        assert torch.equal(rows, x[ids])
        if i % 2:
            kept.append((ids, rows))  # held by the caller: must never be overwritten
    for ids, rows in kept:
        assert torch.equal(rows, x[ids])
    assert feat._buffers.reused >= 2
    plain = Feature(recycle_outputs=False).from_cpu_tensor(x)
    ids = torch.from_numpy(rng.integers(0, n, 4100))
    assert torch.equal(plain[ids], feat[ids]) and plain._buffers is None


def test_concurrent_gathers_with_recycled_outputs_are_exact():
    n, dim = 20000, 32
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(1))
    feat = Feature(num_threads=2).from_cpu_tensor(x)
    errors: list = []
    done = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                ids = torch.from_numpy(rng.integers(0, n, int(rng.integers(8000, 12000))))
                rows = feat[ids]
                if not torch.equal(rows, x[ids]):
                    errors.append(seed)
            done.append(seed)
        except BaseException as e:  # noqa: BLE001 - an exception in a thread fails the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(done) == [0, 1, 2, 3]
    assert feat._buffers.reused > 0
