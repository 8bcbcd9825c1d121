"""Planner: choose each section's (dp, tp, micro-batch size) for a GPU budget.

``plan_maestro`` searches per-section layouts and ``plan_monolithic`` the best whole-model
layout under the same effort (``search``); ``compare``/``breakdown`` report GPU-hours and
where the saving comes from (``report``); ``load_workload`` reads scenarios and run configs
(``workload``); ``TPCostModel`` models tensor parallelism (``tpmodel``).
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
from maestro.plan.tpmodel import TPCostModel, with_layout
from maestro.plan.workload import ScenarioSpec, Workload, load_workload

__all__ = [
    "Ablation",
    "Plan",
    "ScenarioSpec",
    "SearchOptions",
    "SectionPlan",
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
    "with_layout",
]
