"""Mutation checks: break the code the way a test exists to catch, run that test, expect a fail.

Each mutation edits one source file in a scratch copy of the repository (``git worktree``-free:
a temporary copy of ``src`` and ``tests``), runs the named tests there, and reports whether
they failed as they must. Nothing in the working tree is changed.

    .venv/bin/python bench/mutations.py            # every mutation
    .venv/bin/python bench/mutations.py --only kd  # the mutations whose name contains "kd"

Exit code 1 when a mutation survives (its tests pass with the code broken).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: list[str]


MUTATIONS = [
    Mutation(
        "sampler: one marker array shared by every thread",
        "src/quiver/sampling/cpu.py",
        "m = self._local.marker = np.full(self.node_count, -1, dtype=self._marker_dtype)",
        "m = self._local.marker = self.__dict__.setdefault("
        "'_m', np.full(self.node_count, -1, dtype=self._marker_dtype))",
        ["tests/quiver/test_sampling.py::test_concurrent_threads_share_one_cpu_sampler"],
    ),
    Mutation(
        "server: all-zero features served",
        "src/quiver/serving/server.py",
        "        features = ds.features\n",
        "        features = ds.features * 0\n",
        ["tests/quiver/test_serving_cli.py::test_served_logits_equal_an_offline_forward"],
    ),
    Mutation(
        "server: the RAM feature cache returns rows shifted by one",
        "src/quiver/serving/server.py",
        "        engine = Engine(sampler, features, net",
        "        if feature_cache:\n"
        "            _f = features\n"
        "            features = type('F', (), {'__getitem__': lambda s, i: _f[(i + 1) % "
        "ds.num_nodes], 'shape': _f.shape, 'dtype': torch.float32})()\n"
        "        engine = Engine(sampler, features, net",
        ["tests/quiver/test_serving_cli.py::test_served_logits_equal_an_offline_forward"],
    ),
    Mutation(
        "all-reduce: a gradient missing on this replica stays missing",
        "src/maestro/runtime/executor.py",
        "if flag > 0 else None",
        "if flag > 0 and p.grad is not None else None",
        [
            "tests/maestro/test_runtime_units.py::test_flat_allreduce_keeps_missing_gradients_missing"
        ],
    ),
    Mutation(
        "wavefront: keeps its slowest greedy pass",
        "src/maestro/schedule/wavefront.py",
        "        if best is None or t < best_t - 1e-12 * max(t, 1.0):\n            best, best_t",
        "        if best is None or t > best_t:\n            best, best_t",
        ["tests/maestro/test_sim_calibrate.py::test_wavefront_is_never_predicted_slower_than_fifo"],
    ),
    Mutation(
        "planner: keeps the costlier of two plans",
        "src/maestro/plan/problem.py",
        "        return cost < ref",
        "        return cost > ref",
        [
            "tests/maestro/test_plan_layouts.py::test_maestro_never_uses_more_gpu_hours_than_monolithic"
        ],
    ),
    Mutation(
        "kd: temperature**2 factor dropped",
        "src/maestro/workloads/kd.py",
        "loss = loss + c.alpha * c.temperature**2 * kl",
        "loss = loss + c.alpha * kl",
        ["tests/maestro/test_workloads.py::test_kd_loss_is_ce_plus_scaled_kl"],
    ),
    Mutation(
        "training: optimizer step removed",
        "src/quiver/training.py",
        "            opt.step()\n            if cfg.compare_mlp:",
        "            pass\n            if cfg.compare_mlp:",
        ["tests/quiver/test_training.py"],
    ),
]


def _pytest(work: Path, tests: list[str]) -> bool:
    """True when ``tests`` pass in the copy ``work`` (its ``src`` first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(work / "src"), HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    return r.returncode == 0


def _copy(tmp: Path) -> Path:
    work = tmp / "copy"
    if work.exists():
        shutil.rmtree(work)
    ignore = shutil.ignore_patterns(".venv", ".git", ".bench-env", "data", "__pycache__")
    shutil.copytree(ROOT, work, ignore=ignore)
    return work


def run(m: Mutation, tmp: Path) -> bool:
    """True when the tests fail on the mutated copy (the mutation is caught)."""
    work = _copy(tmp)
    target = work / m.file
    text = target.read_text()
    if m.old not in text:
        raise SystemExit(f"{m.name}: {m.old!r} not found in {m.file} (update the mutation)")
    target.write_text(text.replace(m.old, m.new, 1))
    return not _pytest(work, m.tests)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="run the mutations whose name contains this")
    args = p.parse_args()
    survived = 0
    chosen = [m for m in MUTATIONS if args.only in m.name]
    with tempfile.TemporaryDirectory() as tmp:
        # the tests must pass on the unmutated code, or "caught" would mean nothing
        tests = sorted({t for m in chosen for t in m.tests})
        if not _pytest(_copy(Path(tmp)), tests):
            print("the tests fail on the unmutated code: fix them first")
            return 2
        for m in chosen:
            caught = run(m, Path(tmp))
            survived += not caught
            print(f"{'caught  ' if caught else 'SURVIVED'}  {m.name}  ({', '.join(m.tests)})")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
