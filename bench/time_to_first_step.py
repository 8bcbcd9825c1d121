"""Time to the first step of the quick start (issue 44 item 3), one or more source trees.

    python bench/time_to_first_step.py [--runs 5] [SRC ...]

Copies ``examples/quickstart`` to a temporary directory, writes its data, then runs
``python -m maestro.cli train run.toml --steps 10`` with ``PYTHONPATH=SRC`` for each source
tree in turn (interleaved, so a busy machine weighs on each alike) and prints, per run, the
seconds from the command's start to the progress bar's first finished step (``1/10``) and
to its exit, then the median per tree. Default SRC: this checkout's ``src``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(src: str, cwd: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "maestro.cli", "train", "run.toml", "--steps", "10"]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    first, seen = None, b""
    while chunk := os.read(p.stdout.fileno(), 65536):
        seen = (seen + chunk)[-4096:]
        if first is None and b"1/10" in seen:
            first = time.time() - t0
    if p.wait() != 0 or first is None:
        raise SystemExit(f"{src}: the run failed (exit {p.returncode})")
    return first, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="*", default=[str(ROOT / "src")])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        qs = Path(tmp) / "quickstart"
        shutil.copytree(ROOT / "examples" / "quickstart", qs)
        env = {**os.environ, "PYTHONPATH": args.src[0]}
        subprocess.run([sys.executable, "make_data.py"], cwd=qs, env=env, check=True)
        firsts: dict[str, list[float]] = {s: [] for s in args.src}
        for _ in range(args.runs):
            for s in args.src:
                first, total = one_run(s, qs)
                firsts[s].append(first)
                load = os.getloadavg()[0]
                print(f"{s}: first step {first:.2f} s, exit {total:.2f} s (load {load:.2f})")
        for s, xs in firsts.items():
            print(f"{s}: median time to first step {statistics.median(xs):.2f} s over {len(xs)}")


if __name__ == "__main__":
    main()
