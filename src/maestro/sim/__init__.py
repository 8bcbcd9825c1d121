"""Simulator: replay any scheduler's output on a cost model, at any scale, in seconds.

``simulate(schedule, samples, sections, cost_model)`` returns a ``SimResult`` (step time,
per-section utilisation and bubbles); ``gantt(result, path)`` draws it; ``scenarios`` builds
paper-like workloads (KD, MLLM, MLLM with audio) for the analytical GPU presets. The event
engine itself is ``maestro.schedule.timeline`` (schedulers score candidates with it); the
simulator never imports the runtime: profiles from real runs are ``maestro.profiling``'s.
"""

from __future__ import annotations

from maestro.schedule.timeline import SectionStats, SimResult, simulate

__all__ = ["SectionStats", "SimResult", "simulate"]
