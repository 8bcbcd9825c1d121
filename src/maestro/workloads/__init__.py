"""Workloads: compound models with random initialisation and synthetic data (no downloads).

``get_workload(config)`` returns the workload named by ``config.workload``:

- ``kd``: frozen decoder teacher -> student (CE + KL, optional top-k logits).
- ``mllm``: ViT-style vision encoder (+ projector) -> decoder LLM; with audio in the modality
  mix, an audio encoder as well.

A workload builds each section with seeded weights (``graph()``), yields global batches
(``batch(step)``), describes them for schedulers (``sample_infos(batch, graph)``) and gives the
loss normaliser (``normaliser(batch)``).
"""

from __future__ import annotations

from maestro.config import TrainConfig
from maestro.workloads.base import Workload


def get_workload(config: TrainConfig) -> Workload:
    """The workload for a validated config."""
    if config.workload == "kd":
        from maestro.workloads.kd import KDWorkload

        return KDWorkload(config)
    if config.workload == "mllm":
        from maestro.workloads.mllm import MLLMWorkload

        return MLLMWorkload(config)
    raise ValueError(f"workload.name: unknown workload {config.workload!r}")


__all__ = ["Workload", "get_workload"]
