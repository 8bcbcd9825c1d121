"""Reports whether each baseline env under .bench-env/ is ready, with its versions and size.

Standard library only, so any Python runs it (`make bench-env` ends with it):

    python3 bench/baselines/check_envs.py            # probe imports and versions
    python3 bench/baselines/check_envs.py --verify   # also run each env's verify_*.py smoke test
    python3 bench/baselines/check_envs.py --json     # one JSON object, for benchmarks to record

Exits 0 when every env asked for is ready (and, with --verify, passed), 1 otherwise. Benchmarks
that need an env call `env_python(name)`, which names the fix (`make bench-env`) when it is absent.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_ROOT = REPO / ".bench-env"
HERE = Path(__file__).resolve().parent

# Per env: the modules that must import, whose __version__ is reported.
ENV_MODULES: dict[str, tuple[str, ...]] = {
    "pyg": ("torch", "torch_geometric", "torch_sparse", "torch_scatter"),
    "dgl": ("torch", "dgl", "torchdata", "numpy"),
}
PROBE_TIMEOUT_S = 180
VERIFY_TIMEOUT_S = 600


@dataclass
class EnvStatus:
    """What check_envs found for one baseline env.

    Args:
        name: env name, a key of ENV_MODULES (the folder under .bench-env/).
        python: path of the env's interpreter.
        ready: the interpreter exists and every module of ENV_MODULES[name] imports.
        versions: module name -> __version__, for the modules that imported.
        size_mib: disk size of the env folder in MiB (0 when absent).
        verified: result of the env's verify_*.py (None when not run).
        detail: why the env is not ready or failed verification, or the verify script's summary.
    """

    name: str
    python: str
    ready: bool = False
    versions: dict[str, str] = field(default_factory=dict)
    size_mib: float = 0.0
    verified: bool | None = None
    detail: str = ""


def env_python(name: str) -> Path:
    """Returns the interpreter of baseline env `name`.

    Args:
        name: "pyg" or "dgl".

    Raises:
        ValueError: `name` is not a known baseline env.
        FileNotFoundError: the env has not been built (the message says to run `make bench-env`).
    """
    if name not in ENV_MODULES:
        raise ValueError(f"unknown baseline env {name!r}; known: {sorted(ENV_MODULES)}")
    python = ENV_ROOT / name / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} does not exist: run `make bench-env` to build it")
    return python


def _dir_size_mib(path: Path) -> float:
    # du counts hard links once and is much faster than walking ~100k files from Python.
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=False)
    return int(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout else 0.0


def probe(name: str) -> EnvStatus:
    """Imports ENV_MODULES[name] in the env's interpreter and collects their versions."""
    python = ENV_ROOT / name / "bin" / "python"
    status = EnvStatus(name=name, python=str(python))
    if not python.exists():
        status.detail = "not built (run `make bench-env`)"
        return status
    status.size_mib = _dir_size_mib(ENV_ROOT / name)
    code = (
        "import importlib, json\n"
        f"mods = {list(ENV_MODULES[name])!r}\n"
        "print(json.dumps({m: getattr(importlib.import_module(m), '__version__', '?') "
        "for m in mods}))\n"
    )
    try:
        out = subprocess.run(
            [str(python), "-c", code],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            cwd=REPO,
            check=False,
        )
    except subprocess.TimeoutExpired:
        status.detail = f"import probe timed out after {PROBE_TIMEOUT_S} s"
        return status
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        status.detail = f"import failed: {lines[-1] if lines else f'exit {out.returncode}'}"
        return status
    status.versions = json.loads(out.stdout.strip().splitlines()[-1])
    status.ready = True
    return status


def verify(status: EnvStatus) -> None:
    """Runs bench/baselines/verify_<name>.py in a ready env; records the outcome in `status`."""
    script = HERE / f"verify_{status.name}.py"
    try:
        out = subprocess.run(
            [status.python, str(script)],
            capture_output=True,
            text=True,
            timeout=VERIFY_TIMEOUT_S,
            cwd=REPO,
            check=False,
        )
    except subprocess.TimeoutExpired:
        status.verified = False
        status.detail = f"{script.name} timed out after {VERIFY_TIMEOUT_S} s"
        return
    status.verified = out.returncode == 0
    # verify_*.py prints its summary on stdout, and exits with its failure on stderr.
    text = out.stdout if out.returncode == 0 else (out.stderr or out.stdout)
    lines = text.strip().splitlines()
    status.detail = lines[-1] if lines else f"exit {out.returncode}"


def format_status(status: EnvStatus) -> str:
    """One human-readable line for one env."""
    state = "ready" if status.ready else "NOT READY"
    if status.verified is not None:
        state += ", verified" if status.verified else ", VERIFY FAILED"
    versions = " ".join(f"{m}={v}" for m, v in status.versions.items())
    size = f"{status.size_mib / 1024:.2f} GiB" if status.size_mib else "-"
    line = f"{status.name:4} {state:24} {size:>9}  {versions}"
    return f"{line}\n     {status.detail}" if status.detail else line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--env", choices=sorted(ENV_MODULES), action="append", help="check only this env"
    )
    parser.add_argument("--verify", action="store_true", help="run each env's smoke test too")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    statuses = []
    for name in args.env or list(ENV_MODULES):
        status = probe(name)
        if args.verify and status.ready:
            verify(status)
        statuses.append(status)

    if args.json:
        print(json.dumps({s.name: asdict(s) for s in statuses}, indent=2))
    else:
        print(f"baseline envs under {ENV_ROOT}:")
        for status in statuses:
            print(format_status(status))
    ok = all(s.ready and s.verified is not False for s in statuses)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
