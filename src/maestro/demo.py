"""``make demo`` for Maestro: runs each capability that exists on an embedded default."""

from __future__ import annotations

from maestro import __version__


def main() -> int:
    print(f"== Maestro {__version__} demo")
    from maestro.cli import main as cli_main

    return cli_main(["info"])


if __name__ == "__main__":
    raise SystemExit(main())
