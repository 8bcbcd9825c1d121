"""torch-quiver's ``quiver.NcclComm`` / ``getNcclId`` on CPU (a gloo group), in the patterns of
torch-quiver's ``tests/python/cuda/test_comm.py`` and its multi-node training examples: the id
made once and handed to workers (``mp.Process`` arguments, or a ``TCPStore``), ``send``/
``recv``, ``allreduce``, ``exchange`` of partitioned rows, and ``DistFeature(feature, info,
comm)`` with one and with two processes per host."""

import os

import pytest
import torch
import torch.multiprocessing as mp

import quiver

pytestmark = pytest.mark.dist

N, DIM = 40, 3


def _x() -> torch.Tensor:
    """Global rows: row v holds v, v + 0.5, v + 0.25 (each row names its node)."""
    v = torch.arange(N, dtype=torch.float32)[:, None]
    return v + torch.tensor([0.0, 0.5, 0.25])


def _host_proc(rank, ws, id, hosts, rank_per_host, out_dir):
    """torch-quiver's child_sendrecv_proc + child_allreduce_proc + child_feat_partition."""
    torch.set_num_threads(1)
    comm = quiver.comm.NcclComm(rank, ws, id, hosts, rank_per_host)
    result = {"rank": comm.rank, "size": comm.size, "host": comm.host}
    # send / recv between ranks 0 and 1 (zeros overwrite ones)
    if rank == 0:
        comm.send(torch.zeros(10), 1)
    elif rank == 1:
        a = torch.ones(10)
        comm.recv(a, 0)
        result["recv"] = a
    # allreduce sums over every process
    t = torch.full((4,), float(rank + 1))
    comm.allreduce(t)
    result["allreduce"] = t
    # exchange: each host asks the others for rows by local id (PartitionInfo.dispatch)
    host = rank // rank_per_host
    global2host = torch.arange(N) % hosts
    info = quiver.PartitionInfo("cpu", host, hosts, global2host)
    feat = _x()[info.local_order]
    ids = torch.randint(0, N, (25,), generator=torch.Generator().manual_seed(rank))
    host2ids, host2orders = info.dispatch(ids)
    host2feats = comm.exchange(host2ids, feat)
    got = torch.zeros(ids.numel(), DIM)
    for h in range(hosts):
        if h == host:
            got[host2orders[h]] = feat[host2ids[h]]
        elif host2ids[h].numel():
            got[host2orders[h]] = host2feats[h]
    result["exchange"] = (ids, got)
    # DistFeature(feature, info, comm): the gather runs over the communicator's group
    dist_feature = quiver.DistFeature(feat, info, comm)
    assert dist_feature.info is info and dist_feature.comm is comm
    result["gather"] = (ids, dist_feature[ids])
    torch.save(result, os.path.join(out_dir, f"r{rank}.pt"))
    comm.destroy()


def _check(out_dir, ws, hosts, rank_per_host):
    x = _x()
    for rank in range(ws):
        res = torch.load(os.path.join(out_dir, f"r{rank}.pt"))
        assert (res["rank"], res["size"], res["host"]) == (rank, ws, rank // rank_per_host)
        if rank == 1:
            assert torch.equal(res["recv"], torch.zeros(10))
        assert torch.equal(res["allreduce"], torch.full((4,), float(ws * (ws + 1) // 2)))
        ids, got = res["exchange"]
        assert torch.equal(got, x[ids]), f"rank {rank}: exchange returned wrong rows"
        ids, got = res["gather"]
        assert torch.equal(got, x[ids]), f"rank {rank}: DistFeature returned wrong rows"


def test_id_passed_to_processes_one_per_host(tmp_path):
    """test_local: ``id = getNcclId()`` in the parent, ``mp.Process(target, (rank, ws, id))``."""
    id = quiver.getNcclId()
    assert isinstance(id, bytes)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_host_proc, args=(r, 2, id, 2, 1, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    _check(str(tmp_path), 2, 2, 1)


def _store_proc(rank, port, hosts, rank_per_host, out_dir):
    """test_dist / the multi-node examples: rank 0 puts the id in a TCPStore, the rest read it."""
    import torch.distributed as dist

    ws = hosts * rank_per_host
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    if rank == 0:
        store.set("id", quiver.getNcclId())
    id = store.get("id")
    _host_proc(rank, ws, id, hosts, rank_per_host, out_dir)


def test_id_through_a_tcp_store_two_processes_per_host(tmp_path):
    """child_feat_partition_pair: 2 hosts x 2 processes; each exchanges with the process of
    its own local index on the other host."""
    from quiver.serving.http import free_port

    mp.start_processes(
        _store_proc, args=(free_port(), 2, 2, str(tmp_path)), nprocs=4, start_method="spawn"
    )
    _check(str(tmp_path), 4, 2, 2)


@pytest.mark.parametrize(
    "args, msg",
    [
        ((2, 2, b"x"), "rank 2 out of range for world size 2"),
        ((0, 4, b"x", 3, 2), r"hosts \(3\) x rank_per_host \(2\) must equal the world size 4"),
        ((0, 2, b"tcp://127.0.0.1:1"), "needs the id from quiver.getNcclId()"),
    ],
)
def test_bad_comm_arguments_are_one_line(args, msg):
    with pytest.raises(ValueError, match=msg):
        quiver.NcclComm(*args)


def test_nccl_id_names_the_rendezvous():
    assert quiver.getNcclId("10.0.0.7", 29500) == b"quiver-gloo://10.0.0.7:29500"
    with pytest.raises(ValueError, match="port must be in"):
        quiver.getNcclId("h", 70000)
