"""Pipelined layouts priced from their real stages, for Maestro's sections and the baselines.

The simulator replays a pipelined replica at its ideal stage throughput (every stage ``1/pp``
of each micro-batch, ``LayoutCostModel.forward_time``). This module adds what that misses,
from the schedule the simulator replayed, with ``maestro.estimate.pipeline``'s one pricing:

- **Stages from their layers.** A section's blocks are cut as evenly as possible
  (``stage_counts``), its LM head on the last stage. In a *whole-model* pipeline (a baseline,
  or Maestro's whole-model candidate) every sequence section (``tokens``: an LLM, a teacher, a
  student) is cut over all stages, and an encoder of images or audio, with its projector,
  sits whole on the first stage (Megatron-LM's LLaVA with no encoder pipeline size): a frozen
  teacher inside the student's pipeline pays its stages' imbalance too.
- **1F1B per micro-batch.** Each replica's micro-batches keep their own durations per stage
  (``replay_1f1b``), so long samples and image-heavy micro-batches make the bubbles they make
  on GPUs; the fill's and drain's sends are priced once (``stage_send_seconds``).

``pipeline_excess`` is the step time the replay adds over the ideal throughput the simulator
already counted: ``max_r makespan_r - max_r ideal_r`` (never negative).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from maestro.costmodel import micro_batch_features
from maestro.estimate.pipeline import pipeline_makespan, stage_counts, stage_send_seconds
from maestro.plan.tpmodel import LayoutCostModel
from maestro.schedule.types import SampleInfo, Schedule


def section_stages(
    cm: LayoutCostModel, section: str, pp: int, whole_model: bool
) -> tuple[list[int], int | None]:
    """``(blocks per stage, the stage holding the LM head or None)`` of ``section`` cut into
    ``pp`` stages; in a whole-model pipeline an encoder sits whole on the first stage."""
    shape = cm.base.shapes[section]
    head = (pp - 1) if shape.vocab else None
    if whole_model and not cm.splits_sequence(section):
        return [shape.layers] + [0] * (pp - 1), (0 if shape.vocab else None)
    return stage_counts(shape.layers, pp), head


def stage_seconds(
    flat: LayoutCostModel,
    section: str,
    feats: Mapping[str, float],
    stages: tuple[list[int], int | None],
    trainable: bool,
) -> tuple[list[float], list[float]]:
    """``(forward, backward)`` seconds of one micro-batch of ``section`` on every stage.

    ``flat``: the layout without pipelining (its tp, cp, fsdp, recompute); the section's
    whole time is split by blocks, its LM head's kernels (``estimate.kernels.head_cost``)
    counted on the head's stage."""
    from maestro.estimate.kernels import head_cost

    counts, head = stages
    f_tot = flat.forward_time(section, feats)
    b_tot = flat.backward_time(section, feats) if trainable else 0.0
    shape = flat.base.shapes[section]
    hf = hb = 0.0
    if head is not None and f_tot > 0:
        pos = shape.computed_positions(flat._per_rank(section, feats))
        base = flat.base
        fw = base._fw
        tp = flat.strategy(section).tp
        hf, hb = head_cost(
            shape.spec, pos, tp, base._hw, fw.kernels, fw.kernel_efficiency * base.efficiency
        )
        hf, hb = min(hf, f_tot), (min(hb, b_tot) if trainable else 0.0)
    layers = max(sum(counts), 1)
    fwd = [c * (f_tot - hf) / layers for c in counts]
    bwd = [c * (b_tot - hb) / layers for c in counts]
    if head is not None:
        fwd[head] += hf
        bwd[head] += hb
    return fwd, bwd


def boundary_bytes(flat: LayoutCostModel, section: str, feats: Mapping[str, float]) -> float:
    """Bytes one stage sends the next for a micro-batch of ``section`` (a sequence section's
    hidden states, as ``maestro estimate`` prices a pipeline hop: twice the bf16
    activations); an encoder on the first stage sends its output inside the sequence."""
    if not flat.splits_sequence(section):
        return 0.0
    shape = flat.base.shapes[section]
    pos = shape.computed_positions(flat._per_rank(section, feats))
    return 2.0 * pos * shape.hidden * 2.0


def pipeline_excess(
    schedule: Schedule,
    samples: Sequence[SampleInfo],
    flat: LayoutCostModel,
    pipelines: Sequence[tuple[tuple[str, ...], int]],
    trainable: Mapping[str, bool],
    whole_model: bool,
) -> float:
    """Seconds per step the real stages' 1F1B adds over the simulator's ideal throughput.

    Args:
        schedule: the schedule the simulator replayed (``order[section][replica]``).
        samples: its samples (by ``sample_id``).
        flat: the layout's cost model without pipelining.
        pipelines: ``(sections, pp)`` of every pipeline: one per pipelined section, or one
            holding every section of a whole-model layout.
        trainable: section -> it runs a backward.
        whole_model: the pipelines hold whole models (encoders on the first stage).

    Returns:
        The largest ``max_r makespan_r - max_r ideal_r`` over the pipelines.
    """
    by_id = {s.sample_id: s for s in samples}
    gpn = flat.base.hw.gpus_per_node
    worst = 0.0
    for members, pp in pipelines:
        if pp <= 1:
            continue
        stages = {n: section_stages(flat, n, pp, whole_model) for n in members}
        strat = flat.strategy(members[0])
        same = pp * strat.tp * strat.cp <= gpn
        replicas = len(schedule.order[members[0]])
        spans, ideals = [], []
        for r in range(replicas):
            count = max(len(schedule.order[n][r]) for n in members)
            fwd, bwd, sends = [], [], []
            for i in range(count):
                f_i, b_i, hop = [0.0] * pp, [0.0] * pp, 0.0
                for n in members:
                    mbs = schedule.order[n][r]
                    if i >= len(mbs) or not mbs[i].sample_ids:
                        continue
                    feats = micro_batch_features(
                        [by_id[s].cost for s in mbs[i].sample_ids if s in by_id]
                    )
                    f, b = stage_seconds(flat, n, feats, stages[n], trainable[n])
                    f_i = [x + y for x, y in zip(f_i, f)]
                    b_i = [x + y for x, y in zip(b_i, b)]
                    hop += boundary_bytes(flat, n, feats)
                fwd.append(f_i)
                bwd.append(b_i)
                sends.append(stage_send_seconds(hop, flat.base.hw, same))
            if not fwd:
                continue
            spans.append(pipeline_makespan(fwd, bwd, sends[0], sends[-1]))
            ideals.append(sum(sum(x) for x in fwd) / pp + sum(sum(x) for x in bwd) / pp)
        if spans:
            worst = max(worst, max(spans) - max(ideals))
    return max(0.0, worst)


__all__ = ["boundary_bytes", "pipeline_excess", "section_stages", "stage_seconds"]
