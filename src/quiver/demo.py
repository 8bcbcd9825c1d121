"""``make demo`` for Quiver: runs each capability that exists on an embedded default."""

from __future__ import annotations

from quiver import __version__


def main() -> int:
    print(f"== Quiver {__version__} demo")
    from quiver.cli import main as cli_main

    return cli_main(["info"])


if __name__ == "__main__":
    raise SystemExit(main())
