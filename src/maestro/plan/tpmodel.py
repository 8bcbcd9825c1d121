"""Parallel layouts as a cost-model transform: TP, FSDP, ZeRO-1 and recompute per section.

The planner and the simulator price a section's strategy with the same model: the layout's
``LayoutCostModel`` wraps the workload's cost model (analytical, or measured on this machine)
and adds what the strategy costs, the way ``maestro.parallel`` runs it:

- **Tensor parallel** (``tp``, Megatron-style, within one NVLink domain): on an analytical
  model every GEMM, attention and elementwise kernel is priced at the per-GPU widths
  (``hidden / tp``, ``ffn / tp``; ``maestro.estimate.kernels``), so narrow shards lose GEMM
  efficiency; on a measured model a replica of ``tp`` ranks does ``1/tp`` of the blocks'
  work. Either pays two all-reduces (sequence parallel: all-gather plus reduce-scatter) of a
  block's activations per block and pass (forward; backward repeats them, and recompute
  repeats the forward's), and holds ``1/tp`` of the weights, optimizer state and activations.
  Gradient all-reduce and optimizer step shrink by ``tp`` too.
- **FSDP** (``fsdp``, FSDP2 ``fully_shard`` per block, then the root): every micro-batch
  all-gathers the section's parameters in its forward (one collective per block and the
  root), again in its backward when ``reshard_after_forward`` (blocks only: the trainable
  root stays gathered), and reduce-scatters its gradients in the backward; the optimizer
  steps a ``1/fsdp`` shard. Memory: parameters, gradients and optimizer state ``/ fsdp``,
  plus one unsharded block in flight. Replicas run in lockstep (``lockstep``): the runtime
  pads a replica with fewer micro-batches, and the simulator does the same.
- **ZeRO-1** (``zero = 1``, needs ``fsdp = 1``): the optimizer state is sharded over the
  ``dp`` replicas (memory, in the planner's ``_fit``); each replica steps ``1/dp`` of it and
  all-gathers the updated parameters.
- **Recompute**: the backward repeats the blocks' forward; memory keeps block inputs only.

Collectives are rings: an all-gather or reduce-scatter of ``B`` bytes over ``n`` ranks costs
``(n - 1) / n * B / bw + (n - 1) * latency``, an all-reduce twice that. On an analytical GPU
model, FSDP's gathers overlap compute (FSDP2 prefetches the next block): only what exceeds
the pass's compute, plus one block's gather, is exposed, and the compute beside the
overlapped part runs slower by the collectives' share of the SMs (``Hardware.overlap_slowdown``,
as ``maestro estimate`` prices it). On a measured (CPU) model the
collectives run on the same cores as the compute and add up.

With every strategy at its default, every method returns the base model's value exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from maestro.costmodel import (
    PADDED,
    AnalyticalCostModel,
    CostModel,
    Features,
    SectionFacts,
    facts_of,
)


@dataclass(frozen=True)
class SectionStrategy:
    """One section's parallel strategy, with the runtime's field names (``SectionConfig``).

    Args:
        tp: tensor-parallel degree (ranks per replica).
        fsdp: FSDP shard degree (data-parallel ranks sharing one copy of the state).
        zero: 1: ZeRO-1 optimizer-state sharding over the ``dp`` replicas (``fsdp = 1``).
        recompute: activation checkpointing per block.
        reshard_after_forward: FSDP gathers the blocks again in the backward.
        pp: pipeline stages per replica (1F1B). A stage runs ``1/pp`` of the blocks and
            holds ``1/pp`` of their state; the planner replays the real stages' 1F1B on
            top (``plan.pipelines``; ``pipeline_bubble`` for equal stages).
        pp_shared: the stages each hold the parameters outside the blocks (embedding, LM
            head) and all-reduce their gradients over the stages once per step, as
            ``maestro train``'s ``pp`` does (``maestro.parallel.pipeline``); ``False``: the
            first stage holds the embedding and the last the head (Megatron-style, the
            baselines').
        cp: context-parallel degree (ring attention): each of the ``cp`` ranks computes
            ``1/cp`` of every sequence of a sequence section and keeps ``1/cp`` of its
            activations, and pays the K/V ring beyond the attention that hides it
            (``maestro.estimate.pipeline.cp_ring_exposed``); an encoder runs whole.
    """

    tp: int = 1
    fsdp: int = 1
    zero: int = 0
    recompute: bool = False
    reshard_after_forward: bool = True
    pp: int = 1
    cp: int = 1
    pp_shared: bool = False

    @property
    def trivial(self) -> bool:
        """Plain replicas: nothing for a layout model to add."""
        return (
            self.tp == 1
            and self.fsdp == 1
            and not self.zero
            and not self.recompute
            and self.pp == 1
            and self.cp == 1
        )


def _ring(nbytes: float, n: int, bw: float, latency: float) -> float:
    """An all-gather or reduce-scatter of ``nbytes`` (the whole tensor) over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * latency


class LayoutCostModel(CostModel):
    """Wrap a cost model with per-section parallel strategies.

    Args:
        base: the workload's model: an ``AnalyticalCostModel`` (its shapes' ``recompute``
            flags are honoured; build it with ``with_layout``) or a measured one whose
            ``facts`` describe every section with a non-trivial strategy.
        strategies: section -> ``SectionStrategy`` (missing sections: plain replicas).
        overlap: FSDP gathers overlap compute (default: on an analytical GPU model).
    """

    def __init__(
        self,
        base: CostModel,
        strategies: Mapping[str, SectionStrategy] | None = None,
        overlap: bool | None = None,
    ):
        self.base = base
        self.strategies = dict(strategies or {})
        self.analytical = isinstance(base, AnalyticalCostModel)
        self.overlap = self.analytical if overlap is None else overlap
        # the simulator reads these from the model it replays on
        for attr in ("gpu", "step_overhead", "contention", "scheduler_s", "whole_model"):
            if hasattr(base, attr):
                setattr(self, attr, getattr(base, attr))
        self._facts: dict[str, SectionFacts] = {}
        for name, s in self.strategies.items():
            for f in ("tp", "fsdp", "pp", "cp"):
                if getattr(s, f) < 1:
                    raise ValueError(f"{f} of section {name!r} must be >= 1, got {getattr(s, f)}")
            if s.cp > 1 and not self.analytical:
                raise ValueError(f"section {name!r}: cp is priced on analytical models only")
            if s.zero and s.fsdp > 1:
                raise ValueError(f"section {name!r}: zero = 1 needs fsdp = 1")
            if s.tp > 1 or s.fsdp > 1 or (s.recompute and not self.analytical):
                facts = facts_of(base, name)
                if facts is None:
                    raise ValueError(
                        f"section {name!r}: tp, fsdp and recompute need the section's "
                        "structure (an analytical model, or a measured one with facts)"
                    )
                self._facts[name] = facts

    # --- pieces -------------------------------------------------------------------------------

    def strategy(self, section: str) -> SectionStrategy:
        return self.strategies.get(section, _PLAIN)

    def lockstep(self, section: str) -> int:
        f = self.strategy(section).fsdp
        return f if f > 1 else 0

    def step_factor(self, kind: str, micro_batch: int) -> float:
        by_size = getattr(self.base, "step_factor", None)
        if by_size is not None:
            return by_size(kind, micro_batch)
        return (getattr(self.base, "step_scale", None) or {}).get(kind, 1.0)

    def _link(self, section: str, ranks: int) -> tuple[float, float]:
        """``(bytes/s, seconds per message)`` of a collective over a group of ``ranks``
        consecutive ranks."""
        if self.analytical:  # NCCL's bus bandwidth, as maestro.estimate prices it
            hw = self.base.hw
            if ranks <= hw.gpus_per_node:
                return hw.nvlink_bw * hw.nvlink_eff, hw.link_latency
            return hw.net_bw * hw.net_eff, hw.link_latency
        return float(getattr(self.base, "link_bw", 2e9)), float(
            getattr(self.base, "link_latency", 50e-6)
        )

    def _positions(self, section: str, feats: Features) -> float:
        if self.analytical:
            return self.base.shapes[section].positions(feats)
        # a padded micro-batch is what the blocks compute on (B, T, C)
        return feats.get(PADDED) or feats.get("tokens", 0.0) or feats.get("samples", 0.0)

    def _tp_comm(self, section: str, feats: Features, allreduces: float) -> float:
        t = self.strategy(section).tp
        if t <= 1 or feats.get("samples", 0.0) <= 0:
            return 0.0
        if self.analytical:  # sequence parallel: an all-reduce is an all-gather + a reduce-scatter
            from maestro.estimate.step import ring_time

            shape = self.base.shapes[section]
            nbytes = 2.0 * shape.computed_positions(feats) * shape.hidden  # bf16, one layer
            one = 2.0 * ring_time(nbytes, t, self.base.hw, True)
            return allreduces * shape.layers * one
        fa = self._facts[section]
        nbytes = self._positions(section, feats) * fa.hidden * fa.act_bytes
        bw, lat = self._link(section, t)
        return allreduces * fa.blocks * 2.0 * _ring(nbytes, t, bw, lat)

    def _tp_split(self, section: str, seconds: float, passes: float) -> float:
        t = self.strategy(section).tp
        if t <= 1 or seconds <= 0:
            return seconds
        # (an analytical base prices its kernels at the per-GPU widths: AnalyticalCostModel
        # .pass_times; this split is for measured models)
        bf = self._facts[section].block_fraction
        return seconds * (1.0 - bf) + seconds * bf / t

    def _fsdp_comm(self, section: str, compute: float, backward: bool) -> float:
        """Exposed seconds of one micro-batch's FSDP collectives in one pass."""
        s = self.strategy(section)
        if s.fsdp <= 1:
            return 0.0
        fa = self._facts[section]
        bw, lat = self._link(section, s.fsdp * s.tp)
        full = fa.param_bytes / s.tp
        units = fa.blocks + 1
        if not backward:
            comm = _ring(full, s.fsdp, bw, 0.0) + units * (s.fsdp - 1) * lat
        else:
            comm = 0.0
            if s.reshard_after_forward:  # the blocks again; the trainable root stayed gathered
                comm += _ring(full * fa.block_fraction, s.fsdp, bw, 0.0)
                comm += fa.blocks * (s.fsdp - 1) * lat
            comm += _ring(fa.grad_bytes / s.tp, s.fsdp, bw, 0.0) + units * (s.fsdp - 1) * lat
        if self.overlap:  # prefetched under compute; the first unit's collective is exposed,
            # and the compute beside the rest runs on fewer SMs (maestro.estimate.step)
            slow = self.base.hw.overlap_slowdown - 1.0 if self.analytical else 0.0
            return max(0.0, comm - compute) + comm / units + slow * min(comm, compute)
        return comm

    # --- the CostModel interface --------------------------------------------------------------

    def splits_sequence(self, section: str) -> bool:
        """Context parallelism splits this section's sequence: a ``tokens`` section (an LLM,
        a teacher, a student). An encoder of images or audio runs on its whole inputs on
        every CP rank of the layout, as Megatron-LM's LLaVA runs its vision tower before the
        fused sequence is split."""
        return self.analytical and self.base.shapes[section].unit == "tokens"

    def _per_rank(self, section: str, feats: Features) -> Features:
        """``feats`` as one of ``cp`` context-parallel ranks sees them: ``1/cp`` of every
        sequence (positions and attention pairs; the sample count stays) of a section whose
        sequence CP splits (``splits_sequence``); an encoder's whole inputs otherwise."""
        cp = self.strategy(section).cp
        if cp == 1 or not self.splits_sequence(section):
            return feats
        return {k: (v if k == "samples" else v / cp) for k, v in feats.items()}

    def _cp_ring(self, section: str, feats: Features) -> tuple[float, float]:
        """``(forward, backward)`` exposed seconds of the K/V ring of a micro-batch whose
        per-rank features are ``feats`` (``maestro.estimate.pipeline.cp_ring_exposed``, the
        function ``maestro estimate`` prices it with), over every block."""
        s = self.strategy(section)
        if s.cp <= 1 or not self.splits_sequence(section) or feats.get("samples", 0.0) <= 0:
            return 0.0, 0.0
        from maestro.estimate.kernels import layer_cost
        from maestro.estimate.pipeline import cp_ring_exposed

        base = self.base
        shape = base.shapes[section]
        pos = shape.computed_positions(feats)
        if pos <= 0:
            return 0.0, 0.0
        pairs, mean_len = shape.attention(feats)
        key = ("cp-ring", section, s.tp, s.cp, pos, pairs, shape.recompute)
        got = base._cache.get(key)
        if got is not None:
            return got
        fw = base._fw
        lc = layer_cost(
            shape.spec,
            pos,
            pairs,
            mean_len,
            s.tp,
            "full" if shape.recompute else "none",
            base._hw,
            fw.kernels,
            fw.kernel_efficiency * base.efficiency,
        )
        kv = 2.0 * pos * shape.spec.kv_dim / s.tp * 2.0  # bf16 keys and values
        same = s.cp * s.tp <= base.hw.gpus_per_node
        f, b = cp_ring_exposed(kv, s.cp, lc.attn_fwd, base._hw, same)
        got = base._cache[key] = (shape.layers * f, shape.layers * b)
        return got

    def _shared_params(self, section: str) -> float:
        """Parameters outside the blocks (input embedding and LM head) of an analytical
        section; 0 for a measured model, which knows no parameter split, so its stages
        are priced as ``1/pp`` of the whole section's time and state)."""
        if not self.analytical:
            return 0.0
        spec = self.base.shapes[section].spec
        return float(spec.embedding_params + spec.head_params)

    def _state_params(self, section: str) -> float:
        return float(self.base.shapes[section].state_params) if self.analytical else 0.0

    def pipeline_bubble(self, section: str, feats: Features) -> float:
        """Seconds of 1F1B's fill and drain per step for equal micro-batches like ``feats``
        on equal stages (``(pp - 1)`` stage-times of its forward and backward), from the one
        1F1B replay (``maestro.estimate.pipeline``) the planner uses for real stages."""
        from maestro.estimate.pipeline import pipeline_makespan

        pp = self.strategy(section).pp
        if pp == 1:
            return 0.0
        f, b = self.forward_time(section, feats), self.backward_time(section, feats)
        return pipeline_makespan([[f] * pp] * pp, [[b] * pp] * pp) - pp * (f + b)

    def forward_time(self, section: str, feats: Features) -> float:
        """One rank's forward seconds; a pipelined section's (``pp > 1``) ideal stage share,
        ``1/pp`` of the replica's (the planner replays the real stages' 1F1B on top:
        ``plan.pipelines``)."""
        s = self.strategy(section)
        if s.pp > 1 or s.cp > 1:
            f = self._per_rank(section, feats)
            return (self._forward(section, f) + self._cp_ring(section, f)[0]) / s.pp
        return self._forward(section, feats)

    def backward_time(self, section: str, feats: Features) -> float:
        s = self.strategy(section)
        if s.pp > 1 or s.cp > 1:
            f = self._per_rank(section, feats)
            return (self._backward(section, f) + self._cp_ring(section, f)[1]) / s.pp
        return self._backward(section, feats)

    def _forward(self, section: str, feats: Features) -> float:
        if self.analytical:  # the kernels at the per-GPU widths of the TP group
            f = self.base.pass_times(section, feats, self.strategy(section).tp)[0]
        else:
            f = self._tp_split(section, self.base.forward_time(section, feats), 1.0)
        f += self._tp_comm(section, feats, 2.0)
        if feats.get("samples", 0.0) > 0:
            f += self._fsdp_comm(section, f, backward=False)
        return f

    def _backward(self, section: str, feats: Features) -> float:
        s = self.strategy(section)
        base_b = 0.0 if self.analytical else self.base.backward_time(section, feats)
        if self.analytical:
            passes = 3.0 if self.base.shapes[section].recompute else 2.0
            b = self.base.pass_times(section, feats, s.tp)[1]
        else:
            passes = 3.0 if s.recompute else 2.0
            b = self._tp_split(section, base_b, 2.0)
            if s.recompute:  # the blocks' forward again
                fwd = self.base.forward_time(section, feats)
                b += self._tp_split(section, fwd * self._facts[section].block_fraction, 1.0)
        b += self._tp_comm(section, feats, 2.0 * (passes - 1))
        if feats.get("samples", 0.0) > 0:
            b += self._fsdp_comm(section, b, backward=True)
        return b

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        return self.base.transfer_time(producer, feats, same_node)

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        """The step's tail of ``section`` over ``dp`` data-parallel replicas (``dp * fsdp``
        in the config's terms: the scheduler's replicas). Pipeline stages reduce their own
        ``1/pp`` of the gradients; context-parallel ranks join the data-parallel reduction."""
        s = self.strategy(section)
        if s.pp > 1 or s.cp > 1:
            plain = replace(s, pp=1, cp=1)
            inner = LayoutCostModel(self.base, {**self.strategies, section: plain}, self.overlap)
            t = inner.allreduce_time(section, dp * s.cp, same_node) / s.pp
            if s.pp_shared and s.pp > 1:
                # the shared parameters' gradients (fp32) summed over the stages: one ring
                # all-reduce of their local shards over the pp ranks of each replica
                bw, lat = self._link(section, s.pp * s.tp)
                t += 2.0 * _ring(
                    4.0 * self._shared_params(section) / (s.tp * s.fsdp), s.pp, bw, lat
                )
            return t
        if s.fsdp == 1 and (not s.zero or self.analytical):
            # (analytical: the optimizer step is already priced sharded over the replicas)
            return self.base.allreduce_time(section, dp, same_node) / s.tp
        optim = self.base.allreduce_time(section, 1, same_node)  # the step alone
        if s.fsdp > 1:
            # each rank steps its shard: 1/fsdp (analytical: 1/dp, the optimizer step being
            # priced sharded over every replica); HSDP all-reduces the shards over the groups
            optim /= dp if self.analytical else s.fsdp
            fa = self._facts[section]
            bw, lat = self._link(section, dp * s.tp)
            groups = max(1, dp // s.fsdp)
            ring = 2.0 * _ring(fa.grad_bytes / (s.tp * s.fsdp), groups, bw, lat)
            return optim / s.tp + ring
        # measured ZeRO-1: gradients all-reduced as before, a 1/dp optimizer step, then the
        # updated parameter slices all-gathered
        reduce = self.base.allreduce_time(section, dp, same_node) - optim
        pbytes = float(getattr(self.base, "param_bytes", {}).get(section, 0.0))
        bw, lat = self._link(section, dp * s.tp)
        return (reduce + optim / max(dp, 1) + _ring(pbytes, dp, bw, lat)) / s.tp

    def memory_bytes(self, section: str, feats: Features, trainable: bool) -> float:
        """Peak bytes per rank: the base replica's activations ``/ tp``, its parameters,
        gradients and optimizer state ``/ (tp * fsdp)`` plus, under FSDP, one gathered block
        (and its unsharded gradient) and the gathered root. ZeRO-1's ``1/dp`` is applied by
        the planner (it depends on ``dp``). A measured model without a memory fit counts the
        state only (``SectionFacts.state_bytes``). Pipeline stages hold ``1/pp`` of the
        state; 1F1B's first stage keeps ``pp`` micro-batches of ``1/pp`` of the blocks, one
        micro-batch's worth of activations; a context-parallel rank keeps ``1/cp`` of them."""
        s = self.strategy(section)
        if s.pp > 1 or s.cp > 1:
            plain = replace(s, pp=1, cp=1)
            inner = LayoutCostModel(self.base, {**self.strategies, section: plain}, self.overlap)
            fixed = inner.memory_bytes(section, {"samples": 1.0}, trainable)
            acts = inner.memory_bytes(section, self._per_rank(section, feats), trainable) - fixed
            if s.pp_shared and s.pp > 1:
                # every stage holds the embedding and head (their share of the fixed bytes)
                shared = (
                    fixed * self._shared_params(section) / max(1.0, self._state_params(section))
                )
                return (fixed - shared) / s.pp + shared + max(0.0, acts)
            return fixed / s.pp + max(0.0, acts)
        if self.analytical:
            total = self.base.memory_bytes(section, feats, trainable)
            state = self.base.state_bytes(section, trainable) * (
                1.0 + self.base.fw.allocator_headroom
            )
        else:
            fa = facts_of(self.base, section)
            state = fa.state_bytes if fa is not None else 0.0
            if not trainable and fa is not None:
                state = fa.param_bytes
            total = state
        if s.fsdp == 1:
            return total / s.tp
        acts = max(0.0, total - state)
        out = acts / s.tp + state / (s.tp * s.fsdp)
        if s.fsdp > 1:
            fa = self._facts[section]
            per_block = fa.param_bytes * fa.block_fraction / max(fa.blocks, 1)
            root = fa.param_bytes * (1.0 - fa.block_fraction)
            grad = fa.grad_bytes * fa.block_fraction / max(fa.blocks, 1) if trainable else 0.0
            out += (per_block + grad + root) / s.tp
        return out


_PLAIN = SectionStrategy()


class TPCostModel(LayoutCostModel):
    """``LayoutCostModel`` with tensor parallelism only.

    Args:
        base: the analytical model (its shapes' ``recompute`` flags are honoured).
        tp: section -> tensor-parallel degree (missing sections: 1).
    """

    def __init__(self, base: AnalyticalCostModel, tp: Mapping[str, int] | None = None):
        for name, t in (tp or {}).items():
            if t < 1:
                raise ValueError(f"tp of section {name!r} must be >= 1, got {t}")
        super().__init__(base, {n: SectionStrategy(tp=t) for n, t in (tp or {}).items()})
        self.tp = dict(tp or {})


def with_layout(
    base: CostModel,
    tp: Mapping[str, int] | None = None,
    recompute: Mapping[str, bool] | None = None,
    *,
    strategies: Mapping[str, SectionStrategy] | None = None,
) -> CostModel:
    """The cost model of one candidate layout.

    Args:
        base: the workload's cost model: analytical, or measured with ``facts`` for every
            section whose tp, fsdp or recompute is set (``ValueError`` otherwise).
        tp: section -> tensor-parallel degree (shorthand for ``strategies``).
        recompute: section -> activation recompute on/off (likewise).
        strategies: section -> ``SectionStrategy``; ``tp``/``recompute`` override theirs.

    Returns:
        ``base`` itself when every strategy is plain, else a ``LayoutCostModel``.
    """
    strat = dict(strategies or {})
    for n, t in (tp or {}).items():
        strat[n] = replace(strat.get(n, _PLAIN), tp=t)
    for n, r in (recompute or {}).items():
        strat[n] = replace(strat.get(n, _PLAIN), recompute=bool(r))
    if all(s.trivial for s in strat.values()):
        return base
    if isinstance(base, AnalyticalCostModel):
        shapes = {
            n: (replace(s, recompute=strat[n].recompute) if n in strat else s)
            for n, s in base.shapes.items()
        }
        cache = base._cache
        base = replace(base, shapes=shapes)
        base._cache = cache  # keyed by recompute too: every candidate prices a batch once
    elif any(s.tp > 1 or s.fsdp > 1 or s.recompute for s in strat.values()):
        missing = [
            n
            for n, s in strat.items()
            if (s.tp > 1 or s.fsdp > 1 or s.recompute) and facts_of(base, n) is None
        ]
        if missing:
            raise ValueError(
                f"section {missing[0]!r}: tp > 1, fsdp > 1 and recompute need an analytical "
                "cost model or a measured one with the sections' facts"
            )
    return LayoutCostModel(base, strat)


def config_strategies(config) -> dict[str, SectionStrategy]:
    """``section -> SectionStrategy`` of a run config (``TrainConfig.sections``)."""
    return {
        n: SectionStrategy(
            tp=sc.tp,
            fsdp=sc.fsdp,
            zero=sc.zero,
            recompute=bool(sc.recompute),
            reshard_after_forward=bool(sc.reshard_after_forward),
            pp=sc.pp,
            pp_shared=sc.pp > 1,  # maestro train keeps embeddings and head on every stage
            cp=getattr(sc, "cp", 1),
        )
        for n, sc in config.sections.items()
    }


__all__ = [
    "LayoutCostModel",
    "SectionStrategy",
    "TPCostModel",
    "config_strategies",
    "with_layout",
]
