"""``maestro estimate``: one training job on one layout, priced by the cost model the planner
and the simulator use (``maestro.costmodel.AnalyticalCostModel`` calls the same kernels).

- ``hardware``: accelerator presets with cited peaks and measured ceilings;
- ``models``: transformer presets and Hugging Face ``config.json`` reading;
- ``kernels``: GEMM, flash attention, elementwise and activation costs per block;
- ``framework``: how torchtitan, torchtitan with compile and Megatron-LM run them;
- ``step``: the whole step on a ``Layout`` (``estimate``).
"""

import sys
import types

from maestro.estimate.framework import FRAMEWORKS, Framework, framework
from maestro.estimate.hardware import HARDWARE, Hardware, hardware
from maestro.estimate.models import PRESETS, ModelSpec, from_hf_config, gpt, model
from maestro.estimate.step import Estimate, Layout, estimate, resolve_layout

__all__ = [
    "FRAMEWORKS",
    "HARDWARE",
    "PRESETS",
    "Estimate",
    "Framework",
    "Hardware",
    "Layout",
    "ModelSpec",
    "estimate",
    "framework",
    "from_hf_config",
    "gpt",
    "hardware",
    "model",
    "resolve_layout",
]


class _CallableModule(types.ModuleType):
    """``maestro.estimate(...)`` is ``maestro.estimate.estimate(...)``: the package is also
    the function, as the CLI command is."""

    def __call__(self, *args, **kwargs) -> Estimate:
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
