"""Maestro: training of compound models (distillation, multimodal LLMs) as a graph of sections.

Each section has its own data-parallel degree and micro-batch size; a wavefront scheduler
reorders samples so sections run concurrently while every sample's dependencies hold.
"""

from maestro._version import __version__

__all__ = ["__version__"]
