"""The two output formats of ``maestro.export``: a Hugging Face ``save_pretrained``
directory, and a plain module's safetensors file with ``maestro_section.json``.

Both write into an empty directory (``export`` renames it into place when complete) and add
``maestro_section.json``: which section, checkpoint and step the weights come from, and for a
plain module how ``maestro.load_section`` rebuilds it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: the file naming a section's origin and factory
RECORD = "maestro_section.json"
#: the weights file (the name ``save_pretrained`` uses for a single shard)
WEIGHTS = "model.safetensors"
#: version of ``maestro_section.json``'s layout
FORMAT_VERSION = 1


def is_hf(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (has ``save_pretrained``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def job_tokenizer(job) -> Any:
    """The tokenizer the job names: ``Job(tokenizer=)``, else its dataset's (a
    ``maestro.data.JsonlDataset(tokenizer=)``); ``None`` when it names none."""
    from maestro.data.records import load_tokenizer

    tok = getattr(job, "tokenizer", None)
    if tok is None:
        tok = getattr(getattr(job.dataset, "reader", None), "tokenizer", None)
    return None if tok is None else load_tokenizer(tok)


def _write_record(d: Path, record: dict) -> None:
    (d / RECORD).write_text(json.dumps({"format_version": FORMAT_VERSION, **record}, indent=1))


def write_hf(d: Path, module: nn.Module, sd: dict[str, torch.Tensor], job, record: dict) -> bool:
    """``module.save_pretrained(d)`` with the checkpoint's weights ``sd`` (``module`` may sit
    on the meta device: only its class and config are used), and the job's tokenizer.
    Returns whether tokenizer files were written."""
    floats = {v.dtype for v in sd.values() if v.is_floating_point()}
    if len(floats) == 1:  # config.json's dtype: from_pretrained(dtype="auto") loads it
        module = module.to(next(iter(floats)))  # on the meta device: no copy
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one line per export, no "Writing model shards" bar
    try:  # save_pretrained pops the entries of the dict it is given
        module.save_pretrained(str(d), state_dict=dict(sd))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tok = job_tokenizer(job)
    if tok is not None:
        tok.save_pretrained(str(d))
    _write_record(d, {**record, "kind": "hf", "class": type(module).__name__})
    return tok is not None


def factory_name(factory: Any) -> str | None:
    """``"package.module:qualname"`` of ``factory`` when another process can import it by that
    name (a module-level function or class), else ``None`` (a lambda, a closure, a job file's
    function)."""
    mod, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    if not mod or not qual or "<" in qual or mod == "__main__" or mod.startswith("maestro_job_"):
        return None
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{mod}:{qual}" if obj is factory else None


def write_module(
    d: Path, module: nn.Module, sd: dict[str, torch.Tensor], job, cfg, record: dict
) -> None:
    """``model.safetensors`` (``sd``) and ``maestro_section.json`` naming the factory: an
    importable callable when the section's factory is one, and always the job function and
    run config that build the section (``maestro.load_section``)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    flat = {}
    for k, v in sd.items():  # safetensors stores no shared storage: tied tensors are copied
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        flat[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    save_file(flat, str(d / WEIGHTS), metadata={"format": "pt"})
    factory = job._section(record["section"]).module
    _write_record(
        d,
        {
            **record,
            "kind": "module",
            "class": f"{type(module).__module__}:{type(module).__qualname__}",
            "factory": None if isinstance(factory, nn.Module) else factory_name(factory),
            "job": cfg.job_function,
            "config": cfg.to_dict(),
        },
    )
