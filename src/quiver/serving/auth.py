"""Bearer-token authorisation: who may update a served graph (and, optionally, read it).

The token comes from ``--auth-token-file PATH`` or the ``QUIVER_AUTH_TOKEN`` environment
variable; a request carries ``Authorization: Bearer TOKEN``, compared in constant time
(:func:`hmac.compare_digest`) so the answer's timing does not leak how much of it matched.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

ENV_VAR = "QUIVER_AUTH_TOKEN"
UNAUTHORISED = "send the server's token: Authorization: Bearer TOKEN"


def load_token(path: str | os.PathLike | None = None) -> str | None:
    """The token from ``path`` (its first line, stripped), else ``$QUIVER_AUTH_TOKEN``, else None.

    Raises:
        ValueError: one line: an unreadable or empty file, or an empty variable.
    """
    if path is not None:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"--auth-token-file {path}: {e.strerror or e}") from None
        token = text.splitlines()[0].strip() if text else ""
        if not token:
            raise ValueError(f"--auth-token-file {path}: the file is empty")
        return token
    token = os.environ.get(ENV_VAR)
    if token is not None and not token.strip():
        raise ValueError(f"${ENV_VAR} is set but empty")
    return token.strip() if token else None


def authorised(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` (always, with no token)."""
    if token is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def is_loopback(host: str) -> bool:
    """Whether ``--host`` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_open_writes(host: str, updates: bool, token: str | None) -> None:
    """Refuse (one-line ``ValueError``) a writable graph served beyond loopback without a token."""
    if updates and token is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} would let anyone who reaches the port update the graph: set a token "
            f"with --auth-token-file PATH (or ${ENV_VAR}), or serve read-only with --read-only"
        )
