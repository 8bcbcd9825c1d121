"""The one pricing of pipelines and of context parallelism's ring, for every caller.

``maestro estimate`` (one model, uniform micro-batches), the planner's whole-model layouts
(the baselines and Maestro's own) and Maestro's pipelined sections all price these mechanisms
here, so a layout costs the same whichever side of a comparison it is on:

- **Stages from real layers** (``stage_counts``): blocks cut into contiguous stages as even as
  possible, the first ``layers % pp`` stages one block longer: Megatron-LM's uniform split and
  ``maestro train``'s ``parallel.pipeline.stage_bounds`` alike.
- **1F1B replayed per micro-batch** (``replay_1f1b``, ``pipeline_makespan``): every stage runs
  its warm-up forwards, then one forward and one backward alternately, then its remaining
  backwards (Narayanan et al., SC'21, Fig. 4); an operation starts when the stage is free and
  its input (the previous stage's forward, or the next stage's backward) is done. Each
  micro-batch keeps its own durations on each stage, so a long sample or an image-heavy
  micro-batch stalls the pipeline as it does on GPUs. With ``m`` equal micro-batches the
  replay is exactly ``(m + pp - 1) * (f + b)`` (the textbook bubble, ``(pp - 1) / m``).
- **Stage sends** (``stage_send_seconds``): the fill's and the drain's point-to-point sends of
  one micro-batch's boundary activations (``pp - 1`` hops each); the steady-state sends overlap
  compute.
- **Context parallelism's K/V ring** (``cp_ring_exposed``): ``cp - 1`` hops of a rank's key
  and value chunk per block and pass, hidden under that block's attention (forward) and its
  attention backward (2.5x the forward), only the excess exposed.
"""

from __future__ import annotations

from collections.abc import Sequence


def even_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of ``n`` items cut into ``parts`` contiguous runs as even as
    possible (the first ``n % parts`` one longer): pipeline stages of blocks
    (``maestro.parallel.pipeline.stage_bounds``) and CP chunks of a sequence alike."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(int(n), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def stage_counts(layers: int, pp: int) -> list[int]:
    """Blocks per stage of ``layers`` blocks cut into ``pp`` contiguous stages
    (``even_bounds``)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    return [b - a for a, b in even_bounds(layers, pp)]


def replay_1f1b(fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]]) -> float:
    """Seconds from the first forward to the last backward of one 1F1B pipeline.

    Args:
        fwd: ``fwd[i][s]``, forward seconds of micro-batch ``i`` on stage ``s``.
        bwd: ``bwd[i][s]``, backward seconds likewise (zeros for a forward-only pipeline).

    Returns:
        The makespan (sends apart: ``pipeline_makespan`` adds them).
    """
    m = len(fwd)
    if m == 0:
        return 0.0
    pp = len(fwd[0])
    # each stage's operation order: warm-up forwards, 1F1B, cool-down backwards
    ops: list[list[tuple[str, int]]] = []
    for s in range(pp):
        w = min(pp - 1 - s, m)
        seq = [("F", i) for i in range(w)]
        for k in range(m):
            if w + k < m:
                seq.append(("F", w + k))
            seq.append(("B", k))
        ops.append(seq)
    f_end = [[-1.0] * pp for _ in range(m)]
    b_end = [[-1.0] * pp for _ in range(m)]
    free = [0.0] * pp
    pos = [0] * pp
    left = sum(len(o) for o in ops)
    while left:
        progressed = False
        for s in range(pp):
            while pos[s] < len(ops[s]):
                kind, i = ops[s][pos[s]]
                if kind == "F":
                    dep = f_end[i][s - 1] if s > 0 else 0.0
                    if dep < 0:
                        break
                    f_end[i][s] = max(free[s], dep) + fwd[i][s]
                    free[s] = f_end[i][s]
                else:
                    dep = b_end[i][s + 1] if s < pp - 1 else f_end[i][s]
                    if dep < 0:
                        break
                    b_end[i][s] = max(free[s], dep) + bwd[i][s]
                    free[s] = b_end[i][s]
                pos[s] += 1
                left -= 1
                progressed = True
        assert progressed, "1F1B replay deadlocked"
    return max(free)


def pipeline_makespan(
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
    send_first: float = 0.0,
    send_last: float = 0.0,
    vpp: int = 1,
) -> float:
    """A replica's pipelined seconds per step: the 1F1B replay of its micro-batches, the
    fill's sends (``pp - 1`` hops of the first micro-batch, ``send_first`` seconds each) and
    the drain's (of the last, ``send_last``). Interleaving (``vpp`` virtual stages per rank)
    divides the replay's idle time beyond the busiest stage by ``vpp`` (Narayanan et al.)."""
    if not fwd:
        return 0.0
    pp = len(fwd[0])
    busiest = max(sum(fwd[i][s] + bwd[i][s] for i in range(len(fwd))) for s in range(pp))
    if pp == 1:
        return busiest
    idle = replay_1f1b(fwd, bwd) - busiest
    return busiest + idle / vpp + (pp - 1) * (send_first + send_last)


def stage_send_seconds(nbytes: float, hw, same_node: bool) -> float:
    """One point-to-point hop of ``nbytes`` between neighbouring stages (NCCL's bus bandwidth
    and latency, as every collective here: ``maestro.estimate.step.ring_time`` of a 2-rank
    exchange of twice the bytes)."""
    if nbytes <= 0:
        return 0.0
    bw = hw.nvlink_bw * hw.nvlink_eff if same_node else hw.net_bw * hw.net_eff
    return nbytes / bw + hw.link_latency


def cp_ring_exposed(
    kv_bytes: float, cp: int, attn_fwd: float, hw, same_node: bool
) -> tuple[float, float]:
    """``(forward, backward)`` exposed seconds of one block's K/V ring over ``cp`` ranks.

    Args:
        kv_bytes: one rank's key and value chunk of the block (bf16, its TP shard).
        cp: context-parallel degree.
        attn_fwd: the block's attention forward seconds on one rank (what the ring hides
            under; the backward's attention takes 2.5x, and the backward sends K/V and
            their gradients: twice the bytes).
    """
    if cp <= 1 or kv_bytes <= 0:
        return 0.0, 0.0
    bw = hw.nvlink_bw * hw.nvlink_eff if same_node else hw.net_bw * hw.net_eff
    hop = (cp - 1) * (kv_bytes / bw + hw.link_latency)
    return max(0.0, hop - attn_fwd), max(0.0, 2.0 * hop - 2.5 * attn_fwd)


__all__ = [
    "cp_ring_exposed",
    "even_bounds",
    "pipeline_makespan",
    "replay_1f1b",
    "stage_counts",
    "stage_send_seconds",
]
