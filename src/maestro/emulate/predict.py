"""What the simulator predicts for an emulated run: the same schedule, replayed.

The launcher times a window of steps that starts with a barrier after the first (warm-up)
step, so the comparable prediction is the replay of that many consecutive steps from idle
(``window``: the fill of a frozen section's run-ahead included), next to the steady-state
``period`` the planner reports.

``--monolithic`` runs plain data-parallel replicas (``maestro.runtime.monolithic``: no FSDP,
no padding, one all-reduce per step), whatever ``fsdp`` the config's sections state (the
emulated job prices each replica's compute with it): so its replay has no lockstep either
(``_Replicas``), while a per-section run's replay syncs FSDP shard groups as its runtime does.
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


class _Replicas:
    """``cost_model`` with independent replicas (``lockstep`` 0 for every section)."""

    def __init__(self, cost_model) -> None:
        self._base = cost_model

    def lockstep(self, section: str) -> int:
        return 0

    def __getattr__(self, name: str):
        if name == "_base":  # not yet set (copy, pickle)
            raise AttributeError(name)
        return getattr(self._base, name)


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
    from maestro.schedule.monolithic import (
        balanced_order,
        monolithic_schedule,
        token_balanced_order,
    )

    job = cfg.job()
    graph = job.graph(build=[])
    infos = job.sample_infos(job.batch(0), graph)
    cm = job.cost_model
    specs = cfg.section_specs()
    if monolithic:
        cm = _Replicas(cm)
        specs = [replace(s, dp=world, tp=1) for s in specs]
        if cfg.monolithic_order == "balanced":
            budgets = [s.token_budget for s in specs if s.token_budget is not None]
            infos = balanced_order(
                infos,
                world,
                cm,
                [(s.name, s.frozen) for s in specs],
                cfg.monolithic_micro_batch_size,  # the runtime's cut (runtime.monolithic)
                min(budgets) if budgets else None,
            )
        elif cfg.monolithic_order == "tokens":
            infos = token_balanced_order(infos, world)
        sched = monolithic_schedule(
            infos, specs, world_size=world, micro_batch_size=cfg.monolithic_micro_batch_size
        )
    else:
        sched = resolve_scheduler(cfg.scheduler)(infos, specs, cm)
    n = max(1, steps)
    res = steady_state(sched, infos, specs, cm, steps=n)
    return Prediction(window=res.step_ends[-1] / n, period=res.period, steps=n)


__all__ = ["Prediction", "predict"]
