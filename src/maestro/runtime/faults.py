"""Fault injection for reliability tests, and the non-finite guard's error.

Test hooks (environment variables; unset in normal runs):

- ``MAESTRO_FAULT_KILL_AT_STEP=S``: rank ``MAESTRO_FAULT_KILL_RANK`` (default 1) kills itself
  with SIGKILL in the middle of step ``S`` (after its first micro-batch's forward), on the first
  attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is unset or 0).
- ``MAESTRO_FAULT_NONFINITE_AT_STEP=S``: at step ``S`` the loss of sample 0 is multiplied by
  ``MAESTRO_FAULT_NONFINITE_VALUE`` (``nan``, the default, or ``inf``) where it is computed.
"""

from __future__ import annotations

import os
import signal


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient under ``--on-nonfinite stop`` (no update was applied)."""


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return None if v in (None, "") else int(v)


def kill_point(step: int, rank: int) -> None:
    """SIGKILL this process when the kill hook targets this rank, step and first attempt."""
    at = _env_int("MAESTRO_FAULT_KILL_AT_STEP")
    if at is None or step != at:
        return
    target = _env_int("MAESTRO_FAULT_KILL_RANK")
    if rank != (1 if target is None else target):
        return
    if (_env_int("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def poison_factor(step: int, sample_id: int) -> float | None:
    """The factor that poisons ``sample_id``'s loss at ``step``, or ``None``."""
    at = _env_int("MAESTRO_FAULT_NONFINITE_AT_STEP")
    if at is None or step != at or sample_id != 0:
        return None
    v = os.environ.get("MAESTRO_FAULT_NONFINITE_VALUE", "nan")
    if v not in ("nan", "inf"):
        raise ValueError(f"MAESTRO_FAULT_NONFINITE_VALUE must be nan or inf, got {v!r}")
    return float(v)


def nonfinite_message(step: int, flags: list[float], names: list[str]) -> str | None:
    """Why step ``step`` is non-finite, from the all-reduced ``[loss, grad]`` flags per section."""
    bad = [
        f"{what} in section {n!r}"
        for i, n in enumerate(names)
        for j, what in enumerate(("non-finite loss", "non-finite gradient"))
        if flags[2 * i + j] > 0
    ]
    return f"step {step}: " + ", ".join(bad) if bad else None
