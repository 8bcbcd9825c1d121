"""Maestro: training of compound models (distillation, multimodal LLMs) as a graph of sections.

Each section has its own data-parallel degree and micro-batch size; a wavefront scheduler
reorders samples so sections run concurrently while every sample's dependencies hold.

The public job API (``maestro.Job``, ``maestro.Section``; see ``maestro.job``) is imported on
first use, so ``import maestro.config`` stays free of torch; ``maestro.estimate(...)`` (see
``maestro.estimate``) prices one training job on one parallel layout.
"""

from maestro._version import __version__

__all__ = ["Job", "Parallelism", "Section", "SectionGraph", "__version__", "estimate"]


def __getattr__(name: str):
    if name == "Job":
        from maestro.job import Job

        return Job
    if name == "estimate":  # maestro.estimate(...): one job on one layout, priced
        import importlib

        return importlib.import_module("maestro.estimate")
    if name == "Parallelism":  # how a section's own blocks are sharded and split
        from maestro.parallel.spec import Parallelism

        return Parallelism
    if name in ("Section", "SectionGraph"):
        from maestro import sections

        return getattr(sections, name)
    raise AttributeError(f"module 'maestro' has no attribute {name!r}")
