"""Tensor parallelism and activation recompute as a cost-model transform, for the planner.

Neither the runtime nor ``AnalyticalCostModel`` knows tensor parallelism; the planner models it
(Megatron-style, within one NVLink domain): a replica of ``tp`` GPUs does ``1/tp`` of the
matmul work per GPU, pays two all-reduces of the layer's activations per layer and pass
(forward; backward repeats them, and recompute repeats the forward's), keeps its
per-layer fixed overhead unshared, and holds ``1/tp`` of the weights, optimizer state and
activations (sequence parallel). Gradient all-reduce and optimizer step shrink by ``tp`` too.
With ``tp == 1`` every method returns the base model's value exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from maestro.costmodel import AnalyticalCostModel, CostModel, Features


class TPCostModel(CostModel):
    """Wrap an ``AnalyticalCostModel`` with per-section tensor-parallel degrees.

    Args:
        base: the analytical model (its shapes' ``recompute`` flags are honoured).
        tp: section -> tensor-parallel degree (missing sections: 1).
    """

    def __init__(self, base: AnalyticalCostModel, tp: Mapping[str, int] | None = None):
        self.base = base
        self.tp = dict(tp or {})
        self.gpu = base.gpu  # the simulator reads gpus_per_node from it
        for name, t in self.tp.items():
            if t < 1:
                raise ValueError(f"tp of section {name!r} must be >= 1, got {t}")

    def _comm(self, section: str, feats: Features, allreduces: float) -> float:
        t = self.tp.get(section, 1)
        if t <= 1 or feats.get("samples", 0.0) <= 0:
            return 0.0
        shape = self.base.shapes[section]
        nbytes = 2.0 * shape.positions(feats) * shape.hidden  # bf16 activations of one layer
        g = self.base.gpu
        one = 2.0 * (t - 1) / t * nbytes / g.nvlink_bw + g.link_latency
        return allreduces * shape.layers * one

    def _split(self, section: str, seconds: float, passes: float) -> float:
        t = self.tp.get(section, 1)
        if t <= 1 or seconds <= 0:
            return seconds
        overhead = passes * self.base.shapes[section].layers * self.base.gpu.layer_overhead
        overhead = min(overhead, seconds)
        return (seconds - overhead) / t + overhead

    def forward_time(self, section: str, feats: Features) -> float:
        f = self.base.forward_time(section, feats)
        return self._split(section, f, 1.0) + self._comm(section, feats, 2.0)

    def backward_time(self, section: str, feats: Features) -> float:
        passes = 3.0 if self.base.shapes[section].recompute else 2.0
        b = self.base.backward_time(section, feats)
        return self._split(section, b, passes) + self._comm(section, feats, 2.0 * (passes - 1))

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        return self.base.transfer_time(producer, feats, same_node)

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        return self.base.allreduce_time(section, dp, same_node) / self.tp.get(section, 1)

    def memory_bytes(self, section: str, feats: Features, trainable: bool) -> float:
        """Peak bytes per GPU: the base model's replica peak split over ``tp`` GPUs."""
        return self.base.memory_bytes(section, feats, trainable) / self.tp.get(section, 1)


def with_layout(base: CostModel, tp: Mapping[str, int], recompute: Mapping[str, bool]) -> CostModel:
    """The cost model of one candidate layout.

    Args:
        base: the workload's cost model. Only an ``AnalyticalCostModel`` can model ``tp > 1``
            and recompute; any other model (e.g. measured on this machine) is returned as is.
        tp: section -> tensor-parallel degree.
        recompute: section -> activation recompute on/off.
    """
    if not isinstance(base, AnalyticalCostModel):
        if any(t > 1 for t in tp.values()) or any(recompute.values()):
            raise ValueError("tp > 1 and recompute need an analytical cost model")
        return base
    shapes = {
        n: (replace(s, recompute=recompute[n]) if n in recompute else s)
        for n, s in base.shapes.items()
    }
    return TPCostModel(replace(base, shapes=shapes), tp)
