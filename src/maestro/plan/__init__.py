"""Planner: choose each section's (dp, fsdp, tp, zero, recompute, micro-batch) for a budget.

``plan_maestro`` searches per-section layouts, including sections sharing devices
(``colocate``), and ``plan_monolithic`` the best whole-model layout under the same effort
(``search``); both score layouts by their steady-state step over consecutive steps
(``steady``); ``compare``/``breakdown`` report GPU-hours and where the saving comes from
(``report``); ``load_workload`` reads scenarios and run configs (``workload``);
``LayoutCostModel`` prices each section's parallel strategy, for the search and the
simulator alike (``tpmodel``).
"""

from __future__ import annotations

from maestro.plan.report import breakdown, compare, format_comparison, plan_toml
from maestro.plan.search import (
    Ablation,
    Plan,
    SearchOptions,
    SectionPlan,
    gpus_to_match,
    plan_maestro,
    plan_monolithic,
)
from maestro.plan.steady import SteadyResult, steady_state
from maestro.plan.tpmodel import LayoutCostModel, SectionStrategy, TPCostModel, with_layout
from maestro.plan.workload import ScenarioSpec, Workload, load_workload

__all__ = [
    "Ablation",
    "LayoutCostModel",
    "Plan",
    "ScenarioSpec",
    "SearchOptions",
    "SectionPlan",
    "SectionStrategy",
    "SteadyResult",
    "TPCostModel",
    "Workload",
    "breakdown",
    "compare",
    "format_comparison",
    "gpus_to_match",
    "load_workload",
    "plan_maestro",
    "plan_monolithic",
    "plan_toml",
    "steady_state",
    "with_layout",
]
