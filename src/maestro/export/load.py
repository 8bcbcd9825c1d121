"""``maestro.load_section(DIR)``: a section exported by ``maestro.export``, as a module with
its trained weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torch import nn


def _record(d: Path) -> dict:
    from maestro.export.writers import RECORD

    if not d.is_dir():
        raise FileNotFoundError(f"export directory {d} does not exist")
    path = d / RECORD
    if not path.is_file():
        raise ValueError(f"{d} has no {RECORD} (not written by maestro export)")
    return json.loads(path.read_text())


def _factory(rec: dict, d: Path) -> Callable[[], nn.Module]:
    """The section's factory: the importable one the export named, else the job's."""
    if rec.get("factory"):
        import importlib

        mod, _, qual = rec["factory"].partition(":")
        try:
            obj = importlib.import_module(mod)
            for part in qual.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{d}: cannot import its factory {rec['factory']!r} ({e})") from None
        return obj
    if not rec.get("job") or not rec.get("config"):
        raise ValueError(
            f"section {rec.get('section')!r} in {d} is not a Hugging Face model and no factory "
            "is known; pass load_section(dir, factory=a zero-argument callable building it)"
        )
    from maestro import config as C

    job = C.from_dict(rec["config"]).job()
    sec = job._section(rec["section"])
    return (lambda: sec.module) if isinstance(sec.module, nn.Module) else sec.module


def load_section(path: str | Path, *, factory: Callable[[], nn.Module] | None = None) -> nn.Module:
    """The module of an exported section, with its exported weights (in their dtype).

    Args:
        path: a directory written by ``maestro export`` / ``maestro.export``.
        factory: a zero-argument callable building the module (default: the one the
            export recorded: an importable factory, else the job function and run config).

    A Hugging Face section loads with its class's ``from_pretrained`` (local files only); a
    plain module is built by the factory and loads ``model.safetensors`` strictly.
    """
    from maestro.export.writers import WEIGHTS

    d = Path(path).expanduser()
    rec = _record(d)
    if rec.get("kind") == "hf" and factory is None:
        import transformers

        cls = getattr(transformers, rec["class"], None) or transformers.AutoModel
        return cls.from_pretrained(str(d), local_files_only=True, dtype="auto")
    from safetensors.torch import load_file

    sd = load_file(str(d / WEIGHTS))
    module = (factory or _factory(rec, d))()
    if not isinstance(module, nn.Module):
        raise ValueError(f"the factory of {d} returned {type(module).__name__}, not an nn.Module")
    floats = {v.dtype for v in sd.values() if v.is_floating_point()}
    if len(floats) == 1:
        module = module.to(next(iter(floats)))
    module.load_state_dict(sd, strict=True)
    return module
