"""`maestro estimate` against published GPU runs: the calibration table of BENCHMARKS.md.

    python bench/maestro_estimate.py          # the table: estimate vs published, per row
    python bench/maestro_estimate.py --fit    # re-fit the one fitted constant on its row

The rows are the published runs of ``maestro.estimate.calibration.PUBLISHED`` (torchtitan's
docs/performance.md tables and Megatron-LM's H100 weak-scaling table). Exactly one row is
the fit (``fit=True``); every other row is a test of the model.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace


def main(argv=None) -> int:
    from maestro.estimate import calibration, framework

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="bisect kernel_efficiency on the fit row")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    if args.fit:
        row = next(r for r in calibration.PUBLISHED if r.fit)
        lo, hi = 0.3, 1.2
        for _ in range(40):
            mid = (lo + hi) / 2
            fw = replace(framework(row.framework), kernel_efficiency=mid)
            got = calibration.run(row, fw).tokens_per_s_per_gpu
            lo, hi = (mid, hi) if got < row.tokens_per_s else (lo, mid)
        print(f"kernel_efficiency fitted on {row.name!r}: {(lo + hi) / 2:.4f}")
        return 0
    rows = calibration.compare()
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
        return 0
    print(calibration.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
