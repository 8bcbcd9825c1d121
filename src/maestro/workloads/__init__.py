"""Workloads: the built-in jobs and what every job shares.

A workload is a ``maestro.Job`` returned by a job function (see ``maestro.job``). The built-in
ones, with random initialisation and synthetic data (no downloads):

- ``kd`` (``maestro.workloads.kd:job``): frozen decoder teacher -> student (CE + KL,
  optional top-k logits).
- ``mllm`` (``maestro.workloads.mllm:job``): ViT-style vision encoder (+ projector) ->
  decoder LLM; with audio in the modality mix, an audio encoder as well.

``get_workload(config)`` returns the job the config names, bound to it: it builds each
section's seeded module (``graph()``), yields global batches (``batch(step)``), describes them
for schedulers (``sample_infos(batch, graph)``) and gives the loss normaliser
(``normaliser(batch)``).
"""

from __future__ import annotations

from maestro.config import TrainConfig
from maestro.job import Job


def get_workload(config: TrainConfig) -> Job:
    """The job a validated config names, bound to it."""
    return config.job()


#: the interface every workload has (kept for code that names it)
Workload = Job

__all__ = ["Job", "Workload", "get_workload"]
