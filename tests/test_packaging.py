"""Both packages import, and both CLIs answer --help and --version from the installed scripts."""

import subprocess
import sys
from pathlib import Path

import pytest

import maestro
import quiver


@pytest.mark.parametrize("pkg", [quiver, maestro])
def test_package_has_version(pkg):
    assert pkg.__version__ and pkg.__version__[0].isdigit()
    assert pkg.__version__ != "0.0.0+unknown", "package metadata not installed"


def _run(*argv):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("prog", ["quiver", "maestro"])
def test_cli_help_lists_commands(prog):
    exe = Path(sys.executable).parent / prog
    assert exe.exists(), f"console script {prog!r} not installed next to {sys.executable}"
    out = _run(exe, "--help")
    assert out.returncode == 0, out.stderr
    assert "COMMAND" in out.stdout
    # the sub-command list is non-empty: at least 'info' is listed with its help
    assert "info" in out.stdout


@pytest.mark.parametrize("prog,pkg", [("quiver", quiver), ("maestro", maestro)])
def test_cli_version(prog, pkg):
    out = _run(sys.executable, "-m", f"{prog}.cli", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{prog} {pkg.__version__}"


@pytest.mark.parametrize("prog", ["quiver", "maestro"])
def test_cli_info_runs(prog):
    out = _run(sys.executable, "-m", f"{prog}.cli", "info")
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout


@pytest.mark.parametrize("prog", ["quiver", "maestro"])
def test_cli_without_command_prints_help_and_fails(prog):
    out = _run(sys.executable, "-m", f"{prog}.cli")
    assert out.returncode == 2
    assert "usage" in out.stdout


def test_version_matches_pyproject_and_changelog():
    """One version: pyproject.toml's, the installed metadata's (both packages report it) and
    the newest entry of CHANGELOG.md."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).resolve().parents[1]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert quiver.__version__ == maestro.__version__ == version, (
        "installed metadata differs from pyproject.toml: reinstall (make venv)"
    )
    entries = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (root / "CHANGELOG.md").read_text(), re.M)
    assert entries and entries[0] == version, (entries[:1], version)
