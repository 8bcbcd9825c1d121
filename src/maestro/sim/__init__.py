"""Simulator: replay any scheduler's output on a cost model, at any scale, in seconds.

``simulate(schedule, samples, sections, cost_model)`` returns a ``SimResult`` (step time,
per-section utilisation and bubbles); ``gantt(result, path)`` draws it; ``scenarios`` builds
paper-like workloads (KD, MLLM, MLLM with audio) for the analytical GPU presets.
"""

from __future__ import annotations

from maestro.sim.engine import SectionStats, SimResult, simulate

__all__ = ["SectionStats", "SimResult", "simulate"]
