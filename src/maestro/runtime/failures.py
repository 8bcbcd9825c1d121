"""Every failure of ``maestro train`` as a clear message.

- A config mistake (a ``ValueError`` raised by Maestro's own checks, on any rank) is one line.
- An exception raised in the user's own code (their job function, a section's forward) shows
  its message and the traceback trimmed to the user's frames (not Maestro's, torch's, the
  standard library's or an installed package's); ``--debug`` shows the full traceback.
- A rank that dies (a signal, or an exit code without a Python exception) is one line naming
  the rank, its section, the signal or exit code and the step, then how to resume.
- SIGTERM/SIGINT to the launcher stops every rank (``Stopped``) and prints one line.

Spawned ranks write a small report when they fail (``note_failure``) and their current step
(``Progress``) into a directory of the launcher's; when a rank fails the launcher reads them
all and prefers the first real error over the connection errors of the ranks that lost a peer
(``pick``).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

#: exceptions Maestro raises for a user's mistake in the config or the job (one line)
CONFIG_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)

#: a rank's error caused by another rank's failure (it lost its peer), in lower case
_SECONDARY = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "socket timeout",
    "timed out",
    "timeout",
    "connection lost",
)


class Stopped(BaseException):
    """The launcher got SIGTERM or SIGINT and stopped its ranks (not an ``Exception``, like
    ``KeyboardInterrupt``, so no ``except Exception`` between the handler and the launcher's
    clean-up swallows it)."""

    def __init__(self, signum: int, step: int | None = None):
        super().__init__(signum)
        self.signum = signum
        self.step = step
        self.restore_signals = lambda: None  # the launcher sets it (``launch.launch``)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class Failure:
    """One failure, as a rank reports it (JSON) or the launcher sees it.

    ``kind``: ``"config"`` (Maestro's own check: one line), ``"nonfinite"``, ``"user"``
    (raised in the user's code), ``"internal"`` (raised in Maestro/torch), ``"secondary"``
    (a connection error after a peer failed) or ``"died"`` (a signal or an exit code).
    """

    kind: str
    type: str
    message: str
    user_tb: str = ""
    full_tb: str = ""
    rank: int | None = None
    section: str | None = None
    step: int | None = None
    time: float = 0.0

    def where(self) -> str:
        """``"rank 1 (student) at step 3"`` (the parts known)."""
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
            if self.section:
                parts.append(f"({self.section})")
        if self.step is not None:
            parts.append(f"at step {self.step}")
        return " ".join(parts)


class RankFailed(RuntimeError):
    """A spawned rank failed other than by a config error or a non-finite step: its
    ``Failure`` (an exception in the user's code or in Maestro/torch, or its death)."""

    def __init__(self, failure: Failure):
        self.failure = failure
        super().__init__(summary(failure))


def summary(f: Failure) -> str:
    """The failure in one line (without the ``maestro train: error:`` prefix)."""
    if f.kind == "died":
        rank = Failure("", "", "", rank=f.rank, section=f.section).where() or "a rank"
        at = f" at step {f.step}" if f.step is not None else ""
        return f"{rank} {f.message}{at}"
    where = f.where()
    if f.kind in ("config", "nonfinite"):
        return f.message
    head = f"{where}: " if where else ""
    return f"{head}{f.type}: {f.message}" if f.message else f"{head}{f.type}"


# ---------------------------------------------------------------- classifying an exception


def _library_roots() -> tuple[str, ...]:
    import sysconfig

    import maestro

    dirs = {os.path.dirname(maestro.__file__)}
    try:
        import torch

        dirs.add(os.path.dirname(torch.__file__))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(paths[key])
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def is_user_file(filename: str, roots: tuple[str, ...] | None = None) -> bool:
    """A file of the user's (not Maestro's, torch's, the standard library's or an installed
    package's; not a ``<frozen ...>`` pseudo-file)."""
    if not filename or filename.startswith("<"):
        return False
    roots = _library_roots() if roots is None else roots
    return not os.path.realpath(filename).startswith(roots)


def _is_maestro_file(filename: str) -> bool:
    import maestro

    root = os.path.realpath(os.path.dirname(maestro.__file__)) + os.sep
    return os.path.realpath(filename).startswith(root)


def _is_secondary(exc: BaseException, message: str) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    low = message.lower()
    return isinstance(exc, (RuntimeError, OSError)) and any(s in low for s in _SECONDARY)


def classify(exc: BaseException) -> Failure:
    """What ``exc`` is, from its type and where it was raised (its traceback)."""
    from maestro.runtime.faults import NonFiniteError

    frames = traceback.extract_tb(exc.__traceback__)
    roots = _library_roots()
    user = [fr for fr in frames if is_user_file(fr.filename, roots)]
    message = str(exc)
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        message = repr(exc.args[0])
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    raised_in_maestro = bool(frames) and _is_maestro_file(frames[-1].filename)
    if isinstance(exc, NonFiniteError):
        kind = "nonfinite"
    elif isinstance(exc, CONFIG_ERRORS) and (raised_in_maestro or not user):
        kind = "config"
    elif _is_secondary(exc, message):  # even under the user's frames (their collective)
        kind = "secondary"
    elif user:
        kind = "user"
    else:
        kind = "internal"
    user_tb = "".join(traceback.StackSummary.from_list(user).format()) if user else ""
    return Failure(kind, type(exc).__name__, message, user_tb, full, time=time.time())


# ---------------------------------------------------------------- what ranks leave behind


class Progress:
    """A rank's current step and section label in a small file the launcher reads when the
    rank dies (one ``pwrite`` per step)."""

    WIDTH = 256

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.section: str | None = None
        self.step: int | None = None

    def set(self, step: int | None = None, section: str | None = None) -> None:
        if step is not None:
            self.step = step
        if section is not None:
            self.section = section
        line = json.dumps({"step": self.step, "section": self.section})
        try:
            os.pwrite(self.fd, line[: self.WIDTH].ljust(self.WIDTH).encode(), 0)
        except OSError:
            pass

    @staticmethod
    def read(path: str | os.PathLike) -> dict:
        try:
            return json.loads(Path(path).read_text().strip() or "{}")
        except (OSError, ValueError):
            return {}


def progress_path(d: str | os.PathLike, rank: int) -> Path:
    return Path(d) / f"rank{rank}.progress"


def report_path(d: str | os.PathLike, rank: int) -> Path:
    return Path(d) / f"rank{rank}.failure.json"


def write_report(d: str | os.PathLike, rank: int, f: Failure) -> None:
    """Write rank ``rank``'s failure atomically (the launcher may read it at any time)."""
    path = report_path(d, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(f)))
    os.replace(tmp, path)


def read_reports(d: str | os.PathLike, nproc: int) -> list[Failure]:
    out = []
    for r in range(nproc):
        try:
            out.append(Failure(**json.loads(report_path(d, r).read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return out


def pick(reports: list[Failure], death: Failure | None = None) -> Failure | None:
    """The failure to show: the earliest real error (config, non-finite, the user's code,
    Maestro/torch), else a rank's death, else the earliest secondary connection error."""
    real = [f for f in reports if f.kind != "secondary"]
    if real:
        return min(real, key=lambda f: f.time)
    if death is not None:
        return death
    return min(reports, key=lambda f: f.time) if reports else None


def death(rank: int, exit_code: int | None, progress: dict) -> Failure:
    """A rank that exited with ``exit_code`` (negative: killed by that signal) leaving no report."""
    if exit_code is not None and exit_code < 0:
        try:
            what = f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            what = f"was killed by signal {-exit_code}"
    else:
        what = f"exited with code {exit_code}"
    return Failure(
        "died",
        "",
        what,
        rank=rank,
        section=progress.get("section"),
        step=progress.get("step"),
        time=time.time(),
    )


def sink_loss(section: str, out, sample_id=None) -> object:
    """The ``"loss"`` output of a sink section's sample; ``ValueError`` naming the section when
    its forward returned none, ``SampleError`` naming the sample too when it is more than one
    number (a per-token loss vector instead of the sample's sum)."""
    from maestro.sections import SampleError

    if isinstance(out, Mapping) and "loss" in out:
        loss = out["loss"]
        numel = getattr(loss, "numel", None)
        if numel is not None and numel() != 1:
            raise SampleError(
                section,
                sample_id,
                'its forward must return one "loss" number per sample (e.g. summed over the '
                f"sample's tokens); got a tensor of shape {tuple(loss.shape)}",
            )
        return loss
    got = f"keys {sorted(map(str, out))}" if isinstance(out, Mapping) else type(out).__name__
    raise ValueError(
        f'section {section!r} is a sink: its forward must return a "loss" per sample; got {got}'
    )


def lost_peer(f: Failure) -> str:
    """A secondary failure in one line: which rank lost a peer, and where to look."""
    where = f.where() or "a rank"
    first = f.message.strip().splitlines()[0] if f.message.strip() else ""
    # gloo's message continues with advice that does not apply ("This is typically...")
    first = first.split(". This is")[0]
    return (
        f"{where} lost its connection to another rank, which failed or was killed (that "
        f"rank's own output, or torchrun's summary, says why): {f.type}: {first}"
    )


# ---------------------------------------------------------------- the command line's report


def resume_hint(prog: str, argv: list[str], checkpoint_dir: str | None) -> str:
    """How to continue: the same command with ``--resume`` (or how to make a run resumable)."""
    if not checkpoint_dir:
        return (
            "no checkpoint to resume from (--checkpoint-every K --checkpoint-dir D makes a run "
            "resumable)"
        )
    args = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return f"resume with: {prog} {shlex.join(args)}"


def report(
    exc: BaseException,
    prog: str,
    *,
    debug: bool = False,
    hint: str | None = None,
    file=None,
    after_bar: bool = False,
) -> int | None:
    """Print ``exc`` as ``maestro train`` shows failures; the exit code, or ``None`` when the
    caller should let it propagate (an internal error of the launcher process, or a
    ``KeyboardInterrupt``). ``after_bar``: rank 0 showed a progress bar (the line starts on
    a line of its own)."""
    from maestro.runtime.faults import NonFiniteError

    file = sys.stderr if file is None else file

    def say(line: str) -> None:
        print(line, file=file, flush=True)

    tail = f"; {hint}" if hint else ""
    stopped_bar = after_bar or getattr(file, "isatty", lambda: False)()
    if isinstance(exc, (Stopped, RankFailed)) and stopped_bar:
        # rank 0's progress bar, stopped mid-line (a terminal, or a log file: `2> log`)
        file.write("\n")
    if isinstance(exc, Stopped):
        at = f" at step {exc.step}" if exc.step is not None else ""
        say(f"{prog}: stopped by {exc.name}{at}{tail}")
        return exc.exit_code
    if isinstance(exc, RankFailed):
        f = exc.failure
        if debug and f.full_tb:
            file.write(f.full_tb)
        if f.kind == "user":
            say(f"{prog}: error: {summary(f)}")
            if not debug and f.user_tb:
                say("your code (maestro and torch frames hidden; --debug shows them):")
                file.write(f.user_tb)
            # no resume hint: a bug in the user's code is fixed, not resumed past
            return 1
        more = " (--debug shows the traceback)" if f.full_tb and not debug else ""
        say(f"{prog}: error: {summary(f)}{more}{tail}")
        return 1
    if isinstance(exc, KeyboardInterrupt) or not isinstance(exc, Exception):
        return None
    if isinstance(exc, NonFiniteError):
        if debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=file)
        say(f"{prog}: error: {exc}")
        return 1
    f = classify(exc)
    for k, v in getattr(exc, "maestro_where", {}).items():  # a rank's own (torchrun)
        setattr(f, k, v)
    if debug:
        file.write(f.full_tb)
    if f.kind == "config":
        say(f"{prog}: error: {exc}")
        return 2
    if f.kind == "secondary":
        # a rank under torchrun whose peer failed or died: one line, not gloo's traceback
        say(f"{prog}: error: {lost_peer(f)}{'' if debug else ' (--debug shows the traceback)'}")
        return 1
    if f.kind == "user":
        say(f"{prog}: error: {summary(f)}")
        if not debug:
            say("your code (maestro and torch frames hidden; --debug shows them):")
            file.write(f.user_tb)
        return 1
    return None
