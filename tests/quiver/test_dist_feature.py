"""``DistFeature`` over gloo: two real "host" processes on one machine gather exactly x[n_id]."""

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.dist


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, directories, out_dir):
    import torch.distributed as dist

    from quiver.datasets import load_prepared
    from quiver.feature import DistFeature, load_partition

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        for directory in directories:
            _check_host(rank, directory, load_prepared, load_partition, DistFeature)
        torch.save(rank, os.path.join(out_dir, f"ok{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _check_host(rank, directory, load_prepared, load_partition, DistFeature):
    x = load_prepared(directory).features
    part = load_partition(directory)
    feat = DistFeature.from_prepared(directory, num_threads=1)
    n = x.shape[0]
    mine = np.flatnonzero(part.owner == rank)
    theirs = np.flatnonzero(part.owner != rank)
    reps = part.replicas[rank]
    assert reps.size and np.isin(reps, theirs).all()
    unreplicated = np.setdiff1d(theirs, reps)
    gen = torch.Generator().manual_seed(rank)
    cases = [
        torch.randint(0, n, (500,), generator=gen),  # random, with duplicates
        torch.from_numpy(unreplicated[:50]),  # only rows the other host owns
        torch.from_numpy(reps[:20]),  # only replicated rows: no remote read
        torch.from_numpy(np.concatenate([mine[:5], unreplicated[:5]] * 3)),  # duplicates
        torch.zeros(0, dtype=torch.int64),  # empty
    ]
    if rank == 1:  # the hosts' batches need not have the same sizes
        cases[1] = torch.from_numpy(unreplicated[:7])
    local = part.local_ids(rank)
    fetched = 0
    for ids in cases:
        got = feat[ids]
        assert got.dtype == x.dtype and got.shape == (ids.numel(), x.shape[1])
        assert torch.equal(got, x[ids]), f"host {rank}: wrong rows"
        # each distinct row neither owned nor replicated is fetched once per gather
        fetched += np.setdiff1d(np.unique(ids.numpy()), local).size
        assert feat.stats()["remote_rows"] == fetched
    s = feat.stats()
    assert s["remote_rows"] > 0 and s["gathers"] == len(cases)
    try:
        feat[torch.tensor([n])]
    except ValueError as e:
        assert "node ids must lie in" in str(e)
    else:
        raise AssertionError("out-of-range id accepted")


def test_two_hosts_gather_exactly_x_of_n_id(tmp_path):
    """fp32 rows owned by BFS blocks with FAP replicas; bf16 rows owned by hash with random
    replicas (rows travel as raw bytes)."""
    import shutil

    from quiver.cli import main
    from quiver.datasets import convert_features

    d32, d16 = tmp_path / "fp32", tmp_path / "bf16"
    assert main(["prepare", "--dataset", "tiny", "--out", str(d32), "--no-progress"]) == 0
    shutil.copytree(d32, d16)
    convert_features(d16, "bfloat16")
    assert main(["partition", str(d32), "--hosts", "2", "--replicate-budget", "20"]) == 0
    argv = ["--hosts", "2", "--replicate-budget", "0.1", "--policy", "random", "--method", "hash"]
    assert main(["partition", str(d16), *argv]) == 0
    dirs = [str(d32), str(d16)]
    mp.start_processes(
        _worker, args=(_free_port(), dirs, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    assert (tmp_path / "ok0.pt").exists() and (tmp_path / "ok1.pt").exists()


def test_distfeature_needs_an_initialised_group():
    from quiver.feature import DistFeature

    with pytest.raises(ValueError, match="init_process_group"):
        DistFeature(torch.zeros(2, 3), torch.arange(2), torch.zeros(2, dtype=torch.int64))
