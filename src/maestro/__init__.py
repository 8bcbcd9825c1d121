"""Maestro: training of compound models (distillation, multimodal LLMs) as a graph of sections.

Each section has its own data-parallel degree and micro-batch size; a wavefront scheduler
reorders samples so sections run concurrently while every sample's dependencies hold.

The public job API (``maestro.Job``, ``maestro.Section``; see ``maestro.job``) is imported on
first use, so ``import maestro.config`` stays free of torch; ``maestro.estimate(...)`` (see
``maestro.estimate``) prices one training job on one parallel layout;
``maestro.export(...)`` writes a trained section of a checkpoint in the format people load
and ``maestro.load_section(...)`` reads it back (see ``maestro.export``).
"""

from maestro._version import __version__

__all__ = [
    "Job",
    "Parallelism",
    "Section",
    "SectionGraph",
    "__version__",
    "estimate",
    "export",
    "load_section",
]


def __getattr__(name: str):
    if name == "Job":
        from maestro.job import Job

        return Job
    if name == "estimate":  # maestro.estimate(...): one job on one layout, priced
        import importlib

        return importlib.import_module("maestro.estimate")
    if name == "export":  # maestro.export(CHECKPOINT_DIR, SECTION, OUT): the trained model out
        import importlib

        return importlib.import_module("maestro.export")
    if name == "load_section":  # an exported section back as a module
        from maestro.export import load_section

        return load_section
    if name == "Parallelism":  # how a section's own blocks are sharded and split
        from maestro.parallel.spec import Parallelism

        return Parallelism
    if name in ("Section", "SectionGraph"):
        from maestro import sections

        return getattr(sections, name)
    raise AttributeError(f"module 'maestro' has no attribute {name!r}")
