"""bench/gpu_check.py stays runnable without a GPU: its checks pass on CPU tensors."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_cpu(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--sections",
            "sampling,bandwidth",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout.split("== GPU check on")[1]
    assert "PASS  sampling CPU" in table and "PASS  sampling GPU" in table
    assert "PASS  feature device cache 10%" in table and "FAIL" not in table
    assert (tmp_path / "gpu_check.json").exists()
