"""bench/baselines/check_envs.py: readiness probing of the baseline envs, on fake envs.

The real envs (`make bench-env`) are far too big for a test; these fake ones point at the test's
own interpreter, which is enough to exercise the probe, verify and exit-code logic.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "baselines" / "check_envs.py"


@pytest.fixture
def check_envs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("check_envs_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the module's string annotations through sys.modules.
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ENV_ROOT", tmp_path / "envs")
    monkeypatch.setattr(module, "HERE", tmp_path / "scripts")
    (tmp_path / "scripts").mkdir()
    monkeypatch.setattr(module, "ENV_MODULES", {"pyg": ("json",), "dgl": ("csv", "no_such_mod")})
    return module


def make_env(root: Path, name: str) -> None:
    """A fake env: bin/python is this test's interpreter."""
    bin_dir = root / name / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)


def test_env_python_rejects_unknown_and_missing(check_envs):
    with pytest.raises(ValueError, match="unknown baseline env 'spark'"):
        check_envs.env_python("spark")
    with pytest.raises(FileNotFoundError, match="make bench-env"):
        check_envs.env_python("pyg")
    make_env(check_envs.ENV_ROOT, "pyg")
    assert check_envs.env_python("pyg") == check_envs.ENV_ROOT / "pyg" / "bin" / "python"


def test_probe_reports_versions_and_import_failures(check_envs):
    assert check_envs.probe("pyg").detail.startswith("not built")
    make_env(check_envs.ENV_ROOT, "pyg")
    make_env(check_envs.ENV_ROOT, "dgl")

    pyg = check_envs.probe("pyg")
    assert pyg.ready
    assert pyg.versions == {"json": json.__version__}
    assert pyg.size_mib > 0

    dgl = check_envs.probe("dgl")
    assert not dgl.ready
    assert "No module named 'no_such_mod'" in dgl.detail


def test_verify_records_pass_and_failure(check_envs):
    make_env(check_envs.ENV_ROOT, "pyg")
    script = check_envs.HERE / "verify_pyg.py"

    script.write_text("print('noise')\nprint('verify_pyg: ok: 4 batches')\n")
    status = check_envs.probe("pyg")
    check_envs.verify(status)
    assert status.verified is True
    assert status.detail == "verify_pyg: ok: 4 batches"

    script.write_text("import sys\nprint('partial')\nsys.exit('verify_pyg: FAILED: edge')\n")
    status = check_envs.probe("pyg")
    check_envs.verify(status)
    assert status.verified is False
    assert status.detail == "verify_pyg: FAILED: edge"


def test_main_exit_code_and_json(check_envs, capsys):
    make_env(check_envs.ENV_ROOT, "pyg")
    (check_envs.HERE / "verify_pyg.py").write_text("print('verify_pyg: ok')\n")

    assert check_envs.main(["--env", "pyg", "--verify"]) == 0
    assert "pyg  ready, verified" in capsys.readouterr().out

    # dgl is absent, so asking for both envs fails.
    assert check_envs.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["pyg"]["ready"] is True and report["pyg"]["verified"] is None
    assert report["dgl"]["ready"] is False

    (check_envs.HERE / "verify_pyg.py").write_text("import sys\nsys.exit('verify_pyg: FAILED')\n")
    assert check_envs.main(["--env", "pyg", "--verify"]) == 1
    assert "VERIFY FAILED" in capsys.readouterr().out
