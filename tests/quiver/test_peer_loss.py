"""A host shard whose peer is gone: the error names the unreachable host in one line, without
gloo's own text (source paths, addresses, "GLHF! 🏖️"), and the failure is logged once."""

import logging
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from quiver.serving.http import free_port

pytestmark = pytest.mark.dist

N, DIM = 20, 3


def _host(rank, port, out_dir):
    import torch.distributed as dist

    from quiver.feature.peer import PeerFeature

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.arange(N * DIM, dtype=torch.float32).reshape(N, DIM)
    owner = torch.arange(N) % 2
    ids = torch.nonzero(owner == rank).reshape(-1)
    feature = PeerFeature(x[ids], ids, owner, peer_timeout_s=3.0)
    assert torch.equal(feature.gather(torch.arange(N)), x)  # both hosts up: exact
    done = os.path.join(out_dir, f"gathered{rank}")
    open(done, "w").close()
    other = os.path.join(out_dir, f"gathered{1 - rank}")
    while not os.path.exists(other):
        time.sleep(0.05)
    if rank == 1:
        time.sleep(0.3)  # host 0 has its rows too
        os._exit(0)  # gone without a goodbye, as a killed process
    time.sleep(1.0)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("quiver.feature").addHandler(handler)
    messages = []
    for _ in range(3):
        try:
            feature.gather(torch.tensor([1, 0, 3]))
            messages.append("no error")
        except RuntimeError as e:
            messages.append(str(e))
    own = feature.gather(torch.tensor([0, 2]))  # its own rows still read
    logs = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    torch.save((messages, logs, own), os.path.join(out_dir, "host0.pt"))
    os._exit(0)  # gloo's destructors would wait on the dead peer


def test_lost_peer_is_named_in_one_line_without_transport_text(tmp_path):
    mp.spawn(_host, args=(free_port(), str(tmp_path)), nprocs=2)
    messages, logs, own = torch.load(tmp_path / "host0.pt")
    assert torch.equal(own, torch.tensor([[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]))
    for m in messages:
        assert m.startswith("host 1 is unreachable"), messages
        assert "\n" not in m and "GLHF" not in m and "gloo" not in m and ".cc" not in m
    assert len(logs) <= 1 and all("peer host 1 lost" in m and "GLHF" not in m for m in logs)
