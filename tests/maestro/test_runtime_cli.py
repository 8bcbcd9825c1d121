"""``maestro train`` and ``torchrun -m maestro.train``: real processes, results on disk."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maestro import config as C
from maestro.runtime import reference_train
from maestro.runtime.launch import free_port

BIN = Path(sys.executable).parent

TINY = """
global_batch = 6
steps = 2
dtype = "float64"
[workload]
name = "kd"
vocab_size = 24
seq_len_min = 4
seq_len_max = 10
teacher_dim = 8
teacher_layers = 1
student_dim = 4
student_layers = 1
heads = 2
[sections.teacher]
dp = 1
micro_batch_size = 6
frozen = true
[sections.student]
dp = 1
micro_batch_size = 2
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)


def test_bad_config_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.replace("micro_batch_size = 2", "micro_batch_size = 0"))
    r = run([str(BIN / "maestro"), "train", str(bad)])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"maestro train: loading {bad}",  # the start-up line (issue 44 item 3)
        "maestro train: error: sections.student.micro_batch_size must be >= 1, got 0",
    ]
    r = run([str(BIN / "maestro"), "train", str(bad), "--quiet"])
    assert r.stderr.strip().splitlines() == [
        "maestro train: error: sections.student.micro_batch_size must be >= 1, got 0"
    ]


@pytest.mark.dist
def test_cli_monolithic_with_summary_and_result(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = run(
        [
            str(BIN / "maestro"),
            "train",
            str(tiny),
            "--monolithic",
            "--mbs",
            "2",
            "--nproc",
            "2",
            "--result",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["mode"] == "monolithic" and res["layout"]["model"]["micro_batch_size"] == 2
    _, losses = reference_train(C.loads(TINY))
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
    assert "monolithic kd on 2 ranks" in r.stdout and "busy" in r.stdout


@pytest.mark.dist
def test_torchrun_runs_each_rank(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = run(
        [
            str(BIN / "torchrun"),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "maestro.train",
            str(tiny),
            "--quiet",
            "--result",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "maestro" and set(res["busy"]) == {"teacher", "student"}
    _, losses = reference_train(C.loads(TINY))
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-10, atol=0
    )
