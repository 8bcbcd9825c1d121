"""``export``: find the checkpoint, its run config and the section, then hand the merged
state to a writer (``maestro.export.writers``).

Everything a user can get wrong is a one-line ``ValueError`` (or ``FileNotFoundError``):
a missing checkpoint directory, one without a complete checkpoint, an unknown section (the
known ones listed), an output directory that exists and is not empty (unless ``force``), a
checkpoint that records no run config (``config=`` names one), a dtype not offered.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: ``dtype`` names ``export`` takes (``None``: as stored in the checkpoint)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class Exported:
    """What ``export`` wrote.

    Args:
        path: the output directory.
        section: the section's name.
        kind: ``"hf"`` (a ``save_pretrained`` directory) or ``"module"`` (safetensors and
            ``maestro_section.json``).
        step: the checkpoint's ``next_step`` (the steps trained).
        dtype: the weights' floating dtype in the output (``"float32"``, ...).
        num_tensors: tensors in the state dict.
        tokenizer: whether tokenizer files were written.
    """

    path: Path
    section: str
    kind: str
    step: int
    dtype: str
    num_tensors: int
    tokenizer: bool = False

    def line(self) -> str:
        """One line for the command line."""
        if self.kind == "hf":
            what = "a Hugging Face save_pretrained directory"
        else:
            what = "safetensors and maestro_section.json"
        tok = " with the tokenizer" if self.tokenizer else ""
        return (
            f"exported section {self.section!r} (step {self.step}, {self.num_tensors} tensors, "
            f"{self.dtype}) as {what}{tok} to {self.path}"
        )


def _checkpoint(checkpoint_dir: str | Path):
    from maestro.runtime import checkpoint as ck

    d = Path(checkpoint_dir).expanduser()
    if not d.exists():
        raise FileNotFoundError(f"checkpoint directory {d} does not exist")
    if not d.is_dir():
        raise NotADirectoryError(f"checkpoint directory {d} is not a directory")
    skipped: list[str] = []
    found = ck.latest(d, skipped)
    for line in skipped:
        print(f"maestro export: {line}", file=sys.stderr)
    if found is None:
        why = f" ({skipped[-1]})" if skipped else ""
        raise ValueError(f"{d} holds no complete checkpoint{why}")
    return found


def _config(ckpt, meta: dict, config: Any):
    """The run config: ``config`` (a ``TrainConfig`` or a TOML path), else the one the
    checkpoint recorded."""
    from maestro import config as C

    if config is not None:
        return config if isinstance(config, C.TrainConfig) else C.load(config)
    recorded = meta.get("config")
    if recorded is None:
        raise ValueError(
            f"checkpoint {ckpt.dir} records no run config (written by an older Maestro); "
            "pass the run's config: --config RUN.toml (maestro.export(..., config=))"
        )
    return C.from_dict(recorded)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _out_dir(out: str | Path, force: bool) -> Path:
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(
            f"output directory {out} exists and is not empty; pass --force to replace it"
        )
    return out


def shape_module(job, name: str) -> nn.Module:
    """Section ``name``'s module built on the ``meta`` device (no weights): its type, config
    and state-dict keys."""
    sec = job._section(name)
    if isinstance(sec.module, nn.Module):
        return sec.module
    try:
        with torch.device("meta"):
            return sec.module()
    except Exception as e:  # a user's factory: name it, keep one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"section {name!r}: its factory cannot be built on the meta device to learn the "
            f"module's type ({type(e).__name__}: {first})"
        ) from None


def cast(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``sd`` with its floating tensors in ``dtype`` (``None``: unchanged)."""
    if dtype is None:
        return dict(sd)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def check_keys(name: str, sd: dict, module: nn.Module) -> None:
    """``ValueError`` unless ``sd`` holds exactly ``module``'s state-dict keys."""
    want = set(module.state_dict())
    missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the module has not"
        raise ValueError(
            f"section {name!r}: the checkpoint's state {what} ({len(missing)} missing, "
            f"{len(extra)} unexpected keys): was it written by another job?"
        )


def export(
    checkpoint_dir: str | Path,
    section: str,
    out: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    config: Any = None,
) -> Exported:
    """Write section ``section`` of the newest complete checkpoint in ``checkpoint_dir`` to
    directory ``out`` (see the package docstring for the formats).

    Args:
        checkpoint_dir: a ``--checkpoint-dir`` of ``maestro train`` (full or sharded).
        section: the section's name.
        out: the output directory (created; written through a temp directory beside it and
            renamed, so a failed export leaves nothing half written).
        dtype: ``"float32"`` / ``"bfloat16"`` (``fp32`` / ``bf16``); ``None``: as stored.
        force: replace ``out`` when it exists and is not empty.
        config: the run config (a ``TrainConfig`` or TOML path) when the checkpoint
            records none (checkpoints of older Maestro versions).
    """
    from maestro.export import writers

    want = _dtype(dtype)
    out = _out_dir(out, force)
    ckpt = _checkpoint(checkpoint_dir)
    if section not in ckpt.sections:
        raise ValueError(
            f"checkpoint {ckpt.dir} (step {ckpt.next_step}) has no section {section!r}; "
            f"known: {', '.join(ckpt.sections)}"
        )
    cfg = _config(ckpt, ckpt.meta(), config)
    job = cfg.job()
    if section not in [s.name for s in job.sections]:
        raise ValueError(
            f"the job {cfg.workload!r} has no section {section!r}; known: "
            f"{', '.join(s.name for s in job.sections)}"
        )
    module = shape_module(job, section)
    with warnings.catch_warnings():  # DCP's "assuming ... a single process": intended here
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        sd = ckpt.section(section)["module"]  # whole tensors, every shard merged
    check_keys(section, sd, module)
    sd = cast(sd, want)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}.export"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        done = Exported(
            path=out,
            section=section,
            kind="module",
            step=ckpt.next_step,
            dtype=_float_dtype(sd),
            num_tensors=len(sd),
        )
        record = {"section": section, "step": ckpt.next_step, "checkpoint": str(ckpt.dir)}
        if writers.is_hf(module):
            done.kind = "hf"
            done.tokenizer = writers.write_hf(tmp, module, sd, job, record)
        else:
            writers.write_module(tmp, module, sd, job, cfg, record)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


def _float_dtype(sd: dict[str, torch.Tensor]) -> str:
    kinds = {str(v.dtype).removeprefix("torch.") for v in sd.values() if v.is_floating_point()}
    kinds = sorted(kinds)
    return "+".join(kinds) or "none"
