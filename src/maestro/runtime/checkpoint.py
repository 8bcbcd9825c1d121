"""Atomic per-section training checkpoints and the sample-id log that proves exact resume.

A checkpoint taken after step ``s`` (``next_step = s + 1``) in directory ``D`` is:

- ``step-0000000N.SECTION.pt``: one per section, written by one replica of the section's DP
  group (replicas are identical after the SUM all-reduce): ``{"module", "optimizer"}``. A
  section that shards (FSDP, TP, ZeRO-1) gathers its state first, so the file always holds
  whole tensors in a single-rank run's format and any layout resumes from it;
- ``step-0000000N.meta.pt``: written by rank 0: the data position (``next_step``), the losses
  so far, every rank's RNG states, the scheduler name, the LR schedule's total steps
  (``lr_schedule_steps``: a resume under other ``steps`` keeps the schedule), the config
  fingerprint and the whole run config (``config``: ``maestro export`` rebuilds the job from
  it);
- ``step-0000000N.manifest.json``: written *last* by rank 0, after a barrier, naming every file
  with its size and SHA-256. Only a checkpoint whose manifest exists and whose files all match
  it loads, so a crash mid-write (a truncated file, a stray temp file, no manifest) never
  yields a checkpoint that loads; ``latest`` then falls back to the previous complete one.

Every file is written to a temp file in ``D``, fsynced, and ``os.replace``d into place (then
the directory is fsynced), so a reader sees either the old state or the complete new file.
The directory must be shared by all ranks (one machine, or a shared filesystem).

``--checkpoint-format sharded`` (``maestro.parallel.dcp``) replaces each section file with a
directory ``step-0000000N.SECTION/`` that every rank of a sharded section writes its own
shards into with ``torch.distributed.checkpoint`` (a temp directory, renamed when complete);
the manifest then names every file of every directory, with the same rule: only a checkpoint
whose files all match its manifest loads.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from maestro.config import TrainConfig
from maestro.serialization import safe_load

#: complete checkpoints kept in the directory (older ones are pruned after a new manifest)
KEEP = 2
_MANIFEST = re.compile(r"^step-(\d{8})\.manifest\.json$")


def _prefix(next_step: int) -> str:
    return f"step-{next_step:08d}"


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or all of the new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: the section fields a resume must keep (the optimizer and its LR schedule); the layout
#: (dp, fsdp, tp, pp, zero, micro-batches) may change
FINGERPRINT_FIELDS = (
    "frozen",
    "optimizer",
    "lr",
    "weight_decay",
    "optimizer_args",
    "lr_schedule",
    "warmup_steps",
    "min_lr_ratio",
)


def fingerprint(config: TrainConfig) -> dict:
    """What must not change across a resume: the model, the data, the optimizers and their
    LR schedules."""
    d = config.to_dict()
    return {
        "workload": d["workload"],  # its name and the model's shape
        "seed": d["seed"],
        "global_batch": d["global_batch"],
        "dtype": d["dtype"],
        "sections": {
            n: {k: s.get(k) for k in FINGERPRINT_FIELDS} for n, s in d["sections"].items()
        },
    }


def _fingerprint_diff(want: dict, got: dict) -> list[str]:
    """The fields that differ, as config paths (``sections.llm.lr``); a section field an
    older checkpoint did not record is not compared."""
    out = []
    for k in sorted(want):
        if k == "sections" and isinstance(want[k], dict) and isinstance(got.get(k), dict):
            ws, gs = want[k], got[k]
            for n in sorted(set(ws) | set(gs)):
                if n not in ws or n not in gs:
                    out.append(f"sections.{n}")
                    continue
                out += [f"sections.{n}.{f}" for f in ws[n] if ws[n][f] != gs[n].get(f)]
        elif want.get(k) != got.get(k):
            out.append(k)
    return out


def rng_state() -> dict:
    """This process's RNG states (torch CPU, CUDA when present, Python)."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_section(d: Path, next_step: int, name: str, module, optimizer) -> str:
    """Write one section's state; returns the file name (relative to ``d``).

    ``module`` and ``optimizer`` are a module and an optimizer, or their state dicts (a
    sharded section's gathered, whole state: ``maestro.parallel.state``).
    """
    fname = f"{_prefix(next_step)}.{name}.pt"
    msd = module if isinstance(module, dict) else module.state_dict()
    osd = optimizer if optimizer is None or isinstance(optimizer, dict) else optimizer.state_dict()
    state = {"module": {k: v.detach().cpu() for k, v in msd.items()}, "optimizer": osd}
    atomic_write(Path(d) / fname, _torch_bytes(state))
    return fname


def save_meta(d: Path, next_step: int, meta: dict) -> str:
    """Write the run state (rank 0); returns the file name."""
    fname = f"{_prefix(next_step)}.meta.pt"
    atomic_write(Path(d) / fname, _torch_bytes(meta))
    return fname


def section_dir(d: Path, next_step: int, name: str) -> Path:
    """The directory of one section's shards in a sharded checkpoint."""
    return Path(d) / f"{_prefix(next_step)}.{name}"


def commit(d: Path, next_step: int, sections: list[str], fmt: str = "full") -> Path:
    """Write the manifest that makes checkpoint ``next_step`` complete; prune old ones.

    Call only after every rank has written its files (a barrier). ``FileNotFoundError`` when a
    section file (``fmt="full"``) or directory (``fmt="sharded"``) is missing.
    """
    d = Path(d)
    p = _prefix(next_step)
    files = [f"{p}.meta.pt"]
    if fmt == "sharded":
        for n in sections:
            sd = section_dir(d, next_step, n)
            if not sd.is_dir():
                raise FileNotFoundError(f"{sd} is missing")
            files += sorted(f.relative_to(d).as_posix() for f in sd.rglob("*") if f.is_file())
    else:
        files += [f"{p}.{n}.pt" for n in sections]
    entries = {f: {"bytes": (d / f).stat().st_size, "sha256": _sha256(d / f)} for f in files}
    manifest = {"next_step": next_step, "sections": sections, "format": fmt, "files": entries}
    path = d / f"{p}.manifest.json"
    atomic_write(path, json.dumps(manifest, indent=1).encode())
    complete = sorted(_steps_with_manifest(d))
    for old in complete[:-KEEP]:
        for f in d.glob(f"{_prefix(old)}.*"):
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
    return path


def has_manifests(d: str | Path) -> bool:
    """Whether ``d`` holds any checkpoint manifest (complete or not)."""
    return Path(d).is_dir() and bool(_steps_with_manifest(Path(d)))


def discard_newer(d: str | Path, next_step: int) -> None:
    """Remove the manifests of (damaged) checkpoints newer than the one a run resumes from,
    so that pruning never keeps them in place of the checkpoints the resumed run writes."""
    for step in _steps_with_manifest(Path(d)):
        if step > next_step:
            (Path(d) / f"{_prefix(step)}.manifest.json").unlink(missing_ok=True)


def _steps_with_manifest(d: Path) -> list[int]:
    return [int(m.group(1)) for f in d.iterdir() if (m := _MANIFEST.match(f.name))]


def verify(d: Path, next_step: int) -> str | None:
    """``None`` when checkpoint ``next_step`` is complete and intact, else why not."""
    d = Path(d)
    try:
        manifest = json.loads((d / f"{_prefix(next_step)}.manifest.json").read_text())
    except (OSError, ValueError) as e:
        return f"manifest unreadable: {e}"
    for f, want in manifest.get("files", {}).items():
        path = d / f
        if not path.exists():
            return f"{f} is missing"
        if path.stat().st_size != want["bytes"] or _sha256(path) != want["sha256"]:
            return f"{f} does not match the manifest (truncated or corrupted)"
    return None


@dataclass
class Checkpoint:
    """A complete checkpoint on disk.

    Args:
        dir: the checkpoint directory.
        next_step: the first step a resumed run trains.
        sections: the sections it holds state for.
        format: ``"full"`` (one ``.pt`` per section) or ``"sharded"`` (a DCP directory per
            section).
    """

    dir: Path
    next_step: int
    sections: list[str]
    format: str = "full"

    def meta(self) -> dict:
        """The run state written by rank 0."""
        path = self.dir / f"{_prefix(self.next_step)}.meta.pt"
        return safe_load(path)

    def section(self, name: str) -> dict:
        """``{"module": state_dict, "optimizer": state_dict | None}`` of one section."""
        if self.format == "sharded":  # whole tensors, read in this process
            from maestro.parallel.dcp import read_full

            return read_full(section_dir(self.dir, self.next_step, name))
        # CPU first: ``load_state_dict`` moves the state onto the module's device
        path = self.dir / f"{_prefix(self.next_step)}.{name}.pt"
        return safe_load(path)


def latest(d: str | Path, skipped: list[str] | None = None) -> Checkpoint | None:
    """The newest complete, intact checkpoint in ``d`` (``None`` when there is none).

    ``skipped``, when given, receives one line per newer checkpoint passed over, naming
    its file and why (a silent fallback hides a corrupted disk from the user).
    """
    d = Path(d)
    if not d.is_dir():
        return None
    for step in sorted(_steps_with_manifest(d), reverse=True):
        why = verify(d, step)
        if why is not None and skipped is not None:
            skipped.append(f"checkpoint {d}/{_prefix(step)} skipped: {why}")
        if why is None:
            manifest = json.loads((d / f"{_prefix(step)}.manifest.json").read_text())
            fmt = manifest.get("format", "full")
            return Checkpoint(d, step, list(manifest["sections"]), fmt)
    return None


def check_compatible(ckpt: Checkpoint, meta: dict, config: TrainConfig) -> None:
    """``ValueError`` unless ``config`` trains the same model on the same data as the checkpoint."""
    want, got = meta["fingerprint"], fingerprint(config)
    diff = _fingerprint_diff(want, got)
    if diff:
        raise ValueError(
            f"checkpoint {ckpt.dir}/{_prefix(ckpt.next_step)} was written by a different run "
            f"config (differs in: {', '.join(diff)})"
        )
    if ckpt.next_step > config.steps:
        raise ValueError(
            f"checkpoint is at step {ckpt.next_step} but the run has only {config.steps} steps"
        )


class SampleLog:
    """Per-rank JSON-lines log of the samples trained per step (``samples-rankR.jsonl``).

    Lines: ``{"attempt": A, "resume_from": S}`` when an attempt starts, then
    ``{"attempt": A, "step": S, "section": NAME, "replica": I, "ids": [...]}`` after each step
    whose optimizer update ran. Each line is flushed, so a killed rank loses none it wrote.
    """

    def __init__(self, d: Path, rank: int, attempt: int) -> None:
        self.attempt = attempt
        self.f = open(Path(d) / f"samples-rank{rank}.jsonl", "a", buffering=1)

    def write(self, **rec) -> None:
        """Append one record (with this attempt's number)."""
        self.f.write(json.dumps({"attempt": self.attempt, **rec}) + "\n")
        self.f.flush()

    def close(self) -> None:
        """Close the file."""
        self.f.close()


def committed_history(d: str | Path) -> dict[tuple[str, int], list[int]]:
    """``{(section, step): [sample ids]}`` of the run's final history, from every rank's log.

    Each rank's log is read in order; a ``resume_from S`` record drops what that rank logged
    earlier for steps ``>= S`` (those updates were rolled back with the checkpoint). Ids of all
    replicas of a section are concatenated, so a duplicate stays visible as a repeated id.
    Steps logged as skipped (non-finite) are left out.
    """
    out: dict[tuple[str, int], list[int]] = {}
    for f in sorted(Path(d).glob("samples-rank*.jsonl")):
        kept: list[dict] = []
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if "resume_from" in r:
                kept = [k for k in kept if k["step"] < r["resume_from"]]
            elif not r.get("skipped"):
                kept.append(r)
        for r in kept:
            out.setdefault((r["section"], r["step"]), []).extend(r["ids"])
    return out
