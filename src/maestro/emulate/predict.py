"""What the simulator predicts for an emulated run: the same schedule, replayed.

The launcher times a window of steps that starts with a barrier after the first (warm-up)
step, so the comparable prediction is the replay of that many consecutive steps from idle
(``window``: the fill of a frozen section's run-ahead included), next to the steady-state
``period`` the planner reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from maestro.config import TrainConfig


@dataclass
class Prediction:
    """Args: window: mean seconds per step over ``steps`` steps from idle; period: steady
    seconds per step; steps: the steps replayed."""

    window: float
    period: float
    steps: int


def predict(cfg: TrainConfig, *, monolithic: bool, world: int, steps: int) -> Prediction:
    """Replay the schedule the emulated run ``cfg`` (``emulated_config``) computes.

    Args:
        cfg: the emulated run config.
        monolithic: the ``--monolithic`` run (``world`` whole-model replicas).
        world: its ranks.
        steps: the timed steps (the run's ``steps - 1``).
    """
    from maestro.plan.steady import steady_state
    from maestro.runtime.executor import resolve_scheduler
    from maestro.schedule.monolithic import balanced_order, monolithic_schedule

    job = cfg.job()
    graph = job.graph(build=[])
    infos = job.sample_infos(job.batch(0), graph)
    cm = job.cost_model
    specs = cfg.section_specs()
    if monolithic:
        specs = [replace(s, dp=world, tp=1) for s in specs]
        if cfg.monolithic_order == "balanced":
            infos = balanced_order(infos, world, cm, [(s.name, s.frozen) for s in specs])
        sched = monolithic_schedule(
            infos, specs, world_size=world, micro_batch_size=cfg.monolithic_micro_batch_size
        )
    else:
        sched = resolve_scheduler(cfg.scheduler)(infos, specs, cm)
    n = max(1, steps)
    res = steady_state(sched, infos, specs, cm, steps=n)
    return Prediction(window=res.step_ends[-1] / n, period=res.period, steps=n)


__all__ = ["Prediction", "predict"]
