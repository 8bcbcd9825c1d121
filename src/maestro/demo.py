"""``make demo`` for Maestro: runs each capability that exists, on an embedded default.

Add a step to ``STEPS`` per capability; each is a function that prints its own results.
"""

from __future__ import annotations

import time


def _info() -> None:
    from maestro.cli import main as cli_main

    cli_main(["info"])


def _train_kd() -> None:
    """A short KD run on 2 processes beside its monolithic baseline, with the ratio."""
    from pathlib import Path

    from maestro import config as C
    from maestro.runtime import RunOptions, launch

    path = Path(__file__).resolve().parents[2] / "examples" / "kd.toml"
    d = C.load(path).to_dict()
    d.update(steps=5, global_batch=16)
    cfg = C.from_dict(d)
    print("KD (teacher dp=1 mbs=16 frozen, student dp=1 mbs=4) vs monolithic mbs=4, 2 ranks")
    runs = {}
    for mode in ("maestro", "monolithic"):
        opts = RunOptions(monolithic=mode == "monolithic", progress=False)
        r = runs[mode] = launch(cfg, 2, opts, timeout_s=300)
        busy = " ".join(f"{k}={v:.0%}" for k, v in r["busy"].items())
        print(
            f"   {mode:<10} {r['samples_per_s']:6.1f} samples/s  loss {r['losses'][-1]:.4f}  "
            f"busy {busy}"
        )
    ratio = runs["maestro"]["samples_per_s"] / runs["monolithic"]["samples_per_s"]
    print(
        f"   throughput ratio maestro/monolithic: {ratio:.2f}x (same losses: the steps are "
        "equal; on this CPU per-sample cost is flat in micro-batch size, see BENCHMARKS.md)"
    )


#: (title, function) pairs run in order by ``make demo``.
STEPS = [
    ("environment", _info),
    ("train: KD on 2 processes vs monolithic", _train_kd),
]


def main() -> int:
    from maestro import __version__

    print(f"== Maestro {__version__} demo")
    for title, fn in STEPS:
        t0 = time.perf_counter()
        print(f"\n-- {title}")
        fn()
        print(f"   ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
