"""The cost model a training run hands its scheduler (every rank builds the same one).

Schedulers that reorder or balance work (``wavefront``) need per-section cost estimates; with
none they fall back to ``UnitCostModel``, which counts every cost feature equally and so
misjudges sections (one image costs a ViT as much as one text token costs the LLM). A run
therefore uses, in order of preference:

1. ``MeasuredCostModel`` from the profile file the config names (``cost_profile``), e.g. one
   fitted from a real run by ``maestro profile CONFIG --from-run``;
2. the job's own model (``Job(cost_model=)``), e.g. analytical for known hardware;
3. ``FlopCostModel``: FLOPs of every section counted on the ``meta`` device (no weights, no
   compute) for a few micro-batches of the first global batch, fitted linearly in the
   micro-batch features. Deterministic, so every rank schedules identically, and it sees
   padding inside a micro-batch because it runs the sections' real forward code.

Both are deterministic functions of the config (and profile file): schedules, and therefore
losses, are the same on every rank and in every run of the same config.
"""

from __future__ import annotations

from dataclasses import dataclass

from maestro.costmodel import CostModel, LinearFit, MeasuredCostModel, micro_batch_features

#: Rough FLOP/s of one CPU core running these small transformers. Only ratios between
#: sections matter to a scheduler; this scale just keeps the estimate in plausible seconds.
CPU_FLOPS = 5e10


@dataclass
class FlopCostModel(CostModel):
    """Compute time from counted FLOPs; transfers and all-reduces free.

    Args:
        forward_flops: section -> linear fit of forward FLOPs of a micro-batch.
        trainable: section -> whether it runs a backward (twice the forward FLOPs).
        flops_per_s: achieved FLOP/s used to turn FLOPs into seconds.
    """

    forward_flops: dict[str, LinearFit]
    trainable: dict[str, bool]
    flops_per_s: float = CPU_FLOPS

    def forward_time(self, section: str, feats) -> float:
        try:
            return max(0.0, self.forward_flops[section](feats)) / self.flops_per_s
        except KeyError:
            raise ValueError(f"FLOP estimate has no section {section!r}") from None

    def backward_time(self, section: str, feats) -> float:
        return 2.0 * self.forward_time(section, feats) if self.trainable.get(section) else 0.0

    def transfer_time(self, producer: str, feats, same_node: bool) -> float:
        return 0.0

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        return 0.0


def _probe_groups(ids: list[int], sizes=(1, 2, 4)) -> list[list[int]]:
    """Consecutive groups of the given sizes, cycling, until ``ids`` is used up (<= 16 ids)."""
    out, k, j = [], 0, 0
    ids = ids[:16]
    while k < len(ids):
        m = sizes[j % len(sizes)]
        out.append(ids[k : k + m])
        k += m
        j += 1
    return out


def flop_cost_model(config, workload=None) -> FlopCostModel:
    """Count every section's forward FLOPs on the ``meta`` device and fit them per micro-batch.

    Args:
        config: the validated run config.
        workload: its workload (built from ``config`` if omitted).

    Runs the first global batch's samples through the compound model on ``meta`` tensors in
    micro-batches of 1, 2 and 4 (at most 16 samples per section), under
    ``torch.utils.flop_counter.FlopCounterMode``; fits FLOPs against the micro-batch features
    (``samples``, ``tokens``, ``tokens_sq``, ...) with non-negative least squares.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from maestro.workloads import get_workload

    wl = workload if workload is not None else get_workload(config)
    try:
        with torch.device("meta"):
            graph = wl.graph()
    except Exception as e:  # noqa: BLE001 - a factory that cannot build on meta
        _log(
            f"cost estimate: the sections cannot be built on the meta device ({type(e).__name__}"
            f": {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}); every section "
            "is priced by its tokens alone (set cost_profile for measured costs)"
        )
        names = list(config.section_inputs())
        return FlopCostModel(
            {n: LinearFit({"tokens": 1.0}) for n in names},
            {n: not config.sections[n].frozen for n in names},
        )
    batch = [
        {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
        for s in wl.batch(0)
    ]
    cost = {i.sample_id: i.cost for i in wl.sample_infos(batch, graph)}
    by_id = {s["id"]: s for s in batch}
    outs: dict[str, dict[int, dict]] = {}
    fits: dict[str, LinearFit] = {}
    trainable: dict[str, bool] = {}
    fallback: list[str] = []
    for sec in graph:
        outs[sec.name] = {}
        trainable[sec.name] = not sec.frozen
        act = [s["id"] for s in batch if sec.activated(s)]
        rows = []
        try:
            for ids in _probe_groups(act):
                mb = [by_id[i] for i in ids]
                ins = {p: [outs[p].get(i) for i in ids] for p in sec.inputs}
                with torch.no_grad(), FlopCounterMode(display=False) as fc:
                    res = sec.run(mb, ins)
                for i, o in zip(ids, res):
                    outs[sec.name][i] = o
                rows.append(
                    (micro_batch_features(cost[i] for i in ids), float(fc.get_total_flops()))
                )
        except Exception as e:  # noqa: BLE001 - any user module may fail on meta tensors
            # e.g. Hugging Face code calling .item() on a mask: price the section by the
            # classic 2 x parameters x tokens instead (consumers of it are still counted)
            n_params = sum(p.numel() for p in sec.module.parameters())
            fits[sec.name] = LinearFit({"tokens": 2.0 * max(n_params, 1)})
            fallback.append(f"{sec.name} ({type(e).__name__})")
            outs[sec.name] = {}
            continue
        if not rows:
            fits[sec.name] = LinearFit({})
            continue
        fits[sec.name] = _fit_through_origin(rows)
    if fallback:
        _log(
            "cost estimate: FLOPs of "
            + ", ".join(fallback)
            + " cannot be counted on the meta device; those sections are priced at "
            "2 x parameters x tokens (set cost_profile for measured costs)"
        )
    return FlopCostModel(fits, trainable)


#: while a list (``defer_notes``), ``_log`` keeps its lines here instead of printing them: a
#: training run shows them once its first step has run, so a forward that raises is the only
#: thing the user sees (the meta-device probe of that same forward failed first)
_DEFERRED: list[str] | None = None


def defer_notes() -> None:
    """Keep this process's cost-estimate notes until ``deferred_notes()``."""
    global _DEFERRED
    _DEFERRED = []


def deferred_notes() -> list[str]:
    """The notes kept since ``defer_notes()`` (each a full line); printing resumes."""
    global _DEFERRED
    out, _DEFERRED = _DEFERRED or [], None
    return out


def _log(msg: str) -> None:
    """One line on rank 0 (or the only process)."""
    import sys

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        if _DEFERRED is not None:
            _DEFERRED.append(f"maestro: {msg}")
            return
        print(f"maestro: {msg}", file=sys.stderr, flush=True)


def _fit_through_origin(rows: list[tuple[dict, float]]) -> LinearFit:
    """Non-negative least squares without a constant: FLOPs are proportional to the work."""
    import numpy as np
    from scipy.optimize import nnls

    keys = sorted({k for f, _ in rows for k in f})
    a = np.array([[f.get(k, 0.0) for k in keys] for f, _ in rows])
    b = np.array([y for _, y in rows])
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    x, _ = nnls(a / scale, b)
    return LinearFit({k: float(v / s) for k, v, s in zip(keys, x, scale) if v > 0})


def runtime_cost_model(config, workload=None, shared: bool = False) -> CostModel:
    """The cost model a run's scheduler gets: the config's profile, else the job's own
    (``Job(cost_model=)``), else a FLOP estimate.

    ``shared``: a collective of every rank of the default process group (called by all of
    them at the same point): rank 0 alone counts the FLOPs and broadcasts the estimate. Every
    rank used to count them itself: the same model, at a rank's CPU time each (1.7 s for the
    quick start's two GRUs), which ranks sharing cores paid in wall time before the first step.
    """
    profile = getattr(config, "cost_profile", None)
    if profile:
        return MeasuredCostModel.from_profile(profile)
    own = getattr(workload, "cost_model", None)
    if own is not None:
        return own
    import torch.distributed as dist

    if not (shared and dist.is_initialized() and dist.get_world_size() > 1):
        return flop_cost_model(config, workload)
    box = [flop_cost_model(config, workload) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = ["CPU_FLOPS", "FlopCostModel", "flop_cost_model", "runtime_cost_model"]
