"""A run config's sections as the planner reads them: their modules built on the ``meta``
device, and which of them the runtime can split tensor-parallel."""

from __future__ import annotations


def meta_graph(config):
    """The run config's section graph with every module built on the ``meta`` device (its
    data is real; nothing is allocated)."""
    import torch

    from maestro.workloads import get_workload

    wl = get_workload(config)  # (its data is real; only the modules go on meta)
    with torch.device("meta"):
        return wl.graph()


def section_tp_plans(config) -> dict[str, bool]:
    """``section -> whether maestro.parallel can split it tensor-parallel`` for a run config:
    the runtime's rule (``maestro.parallel.apply.module_tp_refusal``) asked of each section's
    module built on the ``meta`` device."""
    from maestro.parallel.apply import module_tp_refusal

    return {
        sec.name: module_tp_refusal(sec.module, spec=sec.parallel) is None
        for sec in meta_graph(config)
    }


__all__ = ["meta_graph", "section_tp_plans"]
