"""The trained model out of Maestro: a section of a checkpoint in the format people load.

``maestro.export(checkpoint_dir, section, out)`` (also ``maestro export CHECKPOINT_DIR
--section NAME --out DIR``) reads the newest complete checkpoint in ``checkpoint_dir``, full
or sharded, written under any layout (tp / fsdp / pp / cp shards are merged here, in one
process, without ``torch.distributed``) and writes one section:

- a Hugging Face model (a ``transformers.PreTrainedModel``, e.g. ``maestro.hf.causal_lm``)
  becomes a ``save_pretrained`` directory: ``config.json``, ``model.safetensors`` and the
  job's tokenizer files when it names a tokenizer (``Job(tokenizer=)`` or its
  ``JsonlDataset``'s), loadable with ``AutoModelForCausalLM.from_pretrained(out)``;
- any other module becomes ``model.safetensors`` (its state dict) and ``maestro_section.json``
  naming its factory (an importable callable, else the job function and run config that
  build it), loadable with ``maestro.load_section(out)``.

Weights are the checkpoint's (a trainable section's fp32 master weights under
``dtype = "bfloat16"``) unless ``dtype`` asks for ``float32`` or ``bfloat16``.

Modules: ``source`` (the checkpoint, its run config and the section's merged state),
``writers`` (the two output formats), ``load`` (``load_section``).
"""

from __future__ import annotations

import sys
import types

from maestro.export.load import load_section
from maestro.export.source import DTYPES, Exported, export

__all__ = ["DTYPES", "Exported", "export", "load_section"]


class _CallableModule(types.ModuleType):
    """``maestro.export(...)`` is ``maestro.export.export(...)``: the package is also the
    function, as the CLI command is (like ``maestro.estimate``)."""

    def __call__(self, *args, **kwargs) -> Exported:
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
