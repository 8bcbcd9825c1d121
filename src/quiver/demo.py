"""``make demo`` for Quiver: runs each capability that exists, on an embedded default.

Add a step to ``STEPS`` per capability; each is a function that prints its own results.
"""

from __future__ import annotations

import time


def _info() -> None:
    from quiver.cli import main as cli_main

    cli_main(["info"])


#: (title, function) pairs run in order by ``make demo``.
STEPS = [
    ("environment", _info),
]


def main() -> int:
    from quiver import __version__

    print(f"== Quiver {__version__} demo")
    for title, fn in STEPS:
        t0 = time.perf_counter()
        print(f"\n-- {title}")
        fn()
        print(f"   ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
