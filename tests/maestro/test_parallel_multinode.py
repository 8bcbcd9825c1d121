"""Two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1) run
one Maestro job whose student section (FSDP over 3 ranks) spans both "nodes"; the result
equals the single-process step (float64)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maestro import config as C
from maestro.runtime import reference_train
from maestro.runtime.launch import free_port
from maestro.workloads import get_workload

BIN = Path(sys.executable).parent

CONFIG = """
global_batch = 8
steps = 3
dtype = "float64"
[workload]
name = "kd"
vocab_size = 32
seq_len_min = 4
seq_len_max = 12
teacher_dim = 16
teacher_layers = 1
student_dim = 16
student_layers = 2
heads = 2
[sections.teacher]
micro_batch_size = 4
frozen = true
[sections.student]
fsdp = 3
micro_batch_size = 2
lr = 0.01
"""


@pytest.mark.dist
def test_two_torchrun_nodes_one_section_across_both(tmp_path):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(CONFIG)
    out, save = tmp_path / "r.json", tmp_path / "save"
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                str(BIN / "torchrun"),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "maestro-multinode-test",
                "--local-addr",
                "127.0.0.1",
                "-m",
                "maestro.train",
                str(cfg_path),
                "--quiet",
                "--result",
                str(out),
                "--save-dir",
                str(save),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    logs = []
    for a in agents:
        try:
            _, err = a.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            raise
        logs.append(err)
    assert all(a.returncode == 0 for a in agents), "\n".join(e[-2000:] for e in logs)
    res = json.loads(out.read_text())
    assert res["world_size"] == 4 and res["layout"]["student"]["fsdp"] == 3
    cfg = C.loads(CONFIG)
    # FSDP degree 3: the shards of params + grads + AdamW state add up to one replica's, and
    # the largest rank holds at most 10% over a third (dim-0 chunks are uneven: 11/11/10 rows)
    n = sum(p.numel() * 8 for p in get_workload(cfg).build_module("student").parameters())
    student = [m for m in res["state_bytes"] if m["label"].startswith("student[")]
    assert len(student) == 3
    assert sum(m["params"] for m in student) == n
    assert max(m["total"] for m in student) <= 1.10 * (4 * n / 3)
    graph, losses = reference_train(cfg)
    sd, ref = torch.load(save / "student.pt"), graph["student"].module.state_dict()
    err = max(float((sd[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    assert err <= 1e-10
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
