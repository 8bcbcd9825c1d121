"""What the planner searches and returns: its options, ablations and plans (data only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

from maestro.schedule.types import SampleInfo

#: The shortest longest-sample for which the search offers context parallelism (torchtitan and
#: Megatron-LM use it from 8k tokens up), to the baselines and Maestro's sections alike.
CP_MIN_TOKENS = 8192
#: Micro-batch sizes the search tries (capped by each section's sample count).
MBS_CHOICES = (1, 2, 4, 8, 16, 32, 64)
#: Tensor-parallel degrees the search tries (capped by GPUs per node).
TP_CHOICES = (1, 2, 4, 8)
#: FSDP shard degrees the search tries (a replica group of ``fsdp * tp`` ranks).
FSDP_CHOICES = (1, 2, 4, 8)
#: The monolithic baseline's samplers (``SearchOptions.monolithic_order``;
#: ``maestro.schedule.monolithic.sampler_order``): data order (a ``DistributedSampler``), a
#: token-count-balanced sampler (``tokens``) and Maestro's cost-aware balancer (``cost``).
MONOLITHIC_ORDERS = ("data", "tokens", "cost")


@dataclass(frozen=True)
class Ablation:
    """Switch off one of Maestro's per-section freedoms (all off = the full planner).

    Args:
        same_mbs: every section uses one micro-batch size (no large forward-only batches).
        same_tp: every section uses one tensor-parallel degree (a small section pays its
            large neighbour's TP; with a section the runtime cannot split, that degree is 1).
        no_skip: every sample activates every section (encoders run on text-only samples,
            as a dummy input would).
        fifo: score with data-order (fifo) scheduling instead of the balancing wavefront.
        disaggregated: every section on its own devices (no colocated groups, and not the
            monolithic layout either).
        no_token_budget: micro-batches cut by sample count only (every section's
            ``token_budget`` off), so long-tailed lengths pad and unbalance them.
    """

    same_mbs: bool = False
    same_tp: bool = False
    no_skip: bool = False
    fifo: bool = False
    disaggregated: bool = False
    no_token_budget: bool = False


@dataclass
class SearchOptions:
    """How hard and where to search.

    Args:
        mbs_choices: micro-batch sizes to try.
        tp_choices: tensor-parallel degrees to try (a measured model: for sections it has
            ``facts`` for, degrees dividing their heads). A section the runtime cannot split
            (``maestro.costmodel.splits_tp``: no transformer block with a TP plan) tries
            ``tp = 1`` only, alone or in a colocated group (``ValueError`` naming it when
            these leave out 1); the monolithic baseline's one tp is not restricted.
        fsdp_choices: FSDP shard degrees to try (FSDP2 ``fully_shard`` per block: state
            ``/ fsdp``, per-micro-batch all-gathers and reduce-scatters).
        zero_choices: per trainable section without FSDP, ZeRO-1 off (0) and/or on (1).
        recompute_choices: activation recompute options for trainable sections.
        memory_fraction: share of the GPU's memory a plan may use (the rest: allocator,
            fragmentation, communication buffers).
        memory_limit: bytes per device; default ``memory_fraction`` of the cost model's GPU
            memory, or no limit when the model has none (measured on this machine).
        keep_per_section: options per section kept after the analytical ranking.
        simulate_top: combinations (or monolithic layouts) replayed in the simulator.
        ablation: freedoms switched off (see ``Ablation``).
        monolithic_order: the sampler of monolithic layouts (``plan_monolithic``, and
            Maestro's own monolithic candidates): ``"data"``, contiguous data-order shards
            (a ``DistributedSampler``: the conventional baseline, a); ``"tokens"``, equal
            token counts per rank and length-sorted micro-batches (``token_balanced_order``,
            as trainers ship: the careful baseline, b'; it never looks at the cost model);
            ``"cost"`` (default; ``"balanced"`` is an alias), equal cost-model work per rank
            (``balanced_order``, Maestro's own cost-aware balancer: the tuned baseline, b).
            ``compare`` plans all three baselines whatever this says.
        balance_monolithic: deprecated alias (init only): ``True`` sets
            ``monolithic_order = "cost"``, ``False`` sets ``"data"``.
        colocate: also search layouts where groups of sections share devices
            (``maestro.plan.colocate``: all sections colocated with per-section micro-batches,
            or e.g. the encoders with the LLM). Off by default. ``"only"``: colocated
            layouts alone (no layout with every section on its own devices; for comparing
            the two families, e.g. ``bench/maestro_colocate.py --sim``). A planned group's
            members share one ``tp`` (the runtime also runs members on their own grids,
            ``runtime.colocated``; the search does not explore those yet).
        include_monolithic: the monolithic layouts (``plan_monolithic``'s search) are
            Maestro candidates too, so Maestro's plan is never slower than the baseline's.
        objective: ``"gpu_hours"``: the fewest GPU-hours per sample (GPUs x step time; a
            plan may leave GPUs of the budget unused); ``"step_time"``: the fastest step on
            at most the budget (e.g. a fixed number of processes on this machine).
        zero1: allow ZeRO-1 at all: ``False`` searches ``zero = 0`` only. With it, each
            trainable section chooses (``zero_choices``) whether to shard its optimizer state
            (fp32 master weights, Adam moments) over its DP group (Megatron's distributed
            optimizer); the monolithic baseline shards it whenever allowed.
        steps: consecutive steps replayed to score a layout (``maestro.plan.steady``); the
            plan's step time is the steady-state period, which lets a frozen section run one
            step ahead exactly as the runtime does.
        batches: further global batches of the same workload (a sample of its data). With
            them, a layout (its own or the monolithic one, not a colocated group) is scored
            by replaying the planned batch then each of these, one step each, and its step
            time is the mean step after the first: one batch's mix of lengths and
            modalities can favour a layout that loses on the others. Each batch must hold
            as many samples as the planned one (``ValueError`` otherwise).
        pp_choices: pipeline stages per replica Maestro's own plans may give a section
            (the runtime's ``pp``: blocks cut into stages, parameters outside them kept on
            every stage); analytical models only, sections with at least as many blocks,
            never inside a colocated group nor with ZeRO-1 (``maestro plan --no-pp``: 1).
        cp_choices: context-parallel degrees Maestro's own plans may give a sequence section
            (the runtime's ``cp``: ring attention over the section's sequences); analytical
            models only, sections whose longest sample reaches ``CP_MIN_TOKENS``, never
            inside a colocated group.
        baseline_pp_choices: pipeline stages (1F1B) the baselines' whole-model search may
            use (they stand for other systems: Megatron-style stages, embeddings on the first
            and head on the last only).
        baseline_cp_choices: context-parallel degrees the baselines may use, likewise.
    """

    mbs_choices: Sequence[int] = MBS_CHOICES
    tp_choices: Sequence[int] = TP_CHOICES
    fsdp_choices: Sequence[int] = FSDP_CHOICES
    zero_choices: Sequence[int] = (0, 1)
    recompute_choices: Sequence[bool] = (False, True)
    memory_fraction: float = 0.9
    memory_limit: float | None = None
    keep_per_section: int = 3
    simulate_top: int = 3
    ablation: Ablation = field(default_factory=Ablation)
    monolithic_order: str = "cost"
    balance_monolithic: InitVar[bool | None] = None
    colocate: bool | str = False
    include_monolithic: bool = True
    steps: int = 4
    batches: Sequence[Sequence[SampleInfo]] = ()
    zero1: bool = True
    objective: str = "gpu_hours"
    pp_choices: Sequence[int] = (1, 2, 4)
    cp_choices: Sequence[int] = (1, 2, 4)
    baseline_pp_choices: Sequence[int] = (1, 2, 4, 8)
    baseline_cp_choices: Sequence[int] = (1, 2, 4)

    def __post_init__(self, balance_monolithic: bool | None) -> None:
        # the alias wins when given (old callers pass only it); ``replace`` passes None
        if balance_monolithic is not None:
            self.monolithic_order = "cost" if balance_monolithic else "data"
        if self.monolithic_order == "balanced":  # maestro.config's name for it
            self.monolithic_order = "cost"
        if self.monolithic_order not in MONOLITHIC_ORDERS:
            raise ValueError(
                f"monolithic_order must be one of {', '.join(MONOLITHIC_ORDERS)}, "
                f"got {self.monolithic_order!r}"
            )


@dataclass(frozen=True)
class SectionPlan:
    """One section's resources, in ``SectionConfig``'s terms: ``dp`` replica groups of
    ``fsdp`` data-parallel ranks of ``tp`` GPUs each, ``dp * fsdp * tp`` GPUs in all.

    Args:
        dp: replica groups (data parallel; HSDP over them when ``fsdp > 1``).
        tp: GPUs per data-parallel rank (tensor parallel).
        micro_batch_size: samples per micro-batch.
        recompute: activation checkpointing in backward.
        memory: predicted peak bytes per GPU (of the whole group, when colocated).
        group: the colocated group it shares devices with (``"a+b"``), or ``""`` when the
            section has devices of its own.
        fsdp: FSDP shard degree inside a replica group.
        zero: 1: ZeRO-1 optimizer-state sharding over the ``dp`` replicas.
        pp: pipeline stages per replica (``maestro train``'s ``pp``; a baseline's stand for
            another system's).
        cp: context-parallel degree (``maestro train``'s ``cp``: ring attention over each
            sequence; a baseline's stands for another system's).
    """

    dp: int
    tp: int
    micro_batch_size: int
    recompute: bool = False
    memory: float = 0.0
    group: str = ""
    fsdp: int = 1
    zero: int = 0
    pp: int = 1
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        """The scheduler's replicas: ``dp * fsdp``."""
        return self.dp * self.fsdp

    def strategy_label(self) -> str:
        """``dp=.. [fsdp=..] tp=..`` and, when set, ``zero=1`` and ``rc``."""
        fs = f" fsdp={self.fsdp}" if self.fsdp > 1 else ""
        z = " zero=1" if self.zero else ""
        pc = (f" pp={self.pp}" if self.pp > 1 else "") + (f" cp={self.cp}" if self.cp > 1 else "")
        return f"dp={self.dp}{fs} tp={self.tp}{pc}{z}"


@dataclass
class Plan:
    """A planned layout and its prediction.

    Args:
        sections: section name -> ``SectionPlan`` (monolithic: every section shares one
            layout and the same GPUs).
        monolithic: the whole model on every replica.
        gpus: GPUs the plan occupies.
        num_samples: samples per step (the global batch).
        step_time: simulated seconds per step.
        estimate: the analytical estimate that ranked it.
        candidates: layouts that passed the memory check; simulated: how many were replayed.
        busy_bound: the busiest GPU's compute plus its all-reduce per step: the step time if
            all pipeline fill and drain overlapped with the neighbouring steps (a lower bound).
        first_step: the first step from an idle start (``maestro.sim.simulate``'s figure);
            ``step_time`` is the steady-state period of consecutive steps.
        order: a monolithic plan's sampler (``MONOLITHIC_ORDERS``) it was scored with;
            ``""`` for a per-section plan.
    """

    sections: dict[str, SectionPlan]
    monolithic: bool
    gpus: int
    num_samples: int
    step_time: float
    estimate: float
    candidates: int = 0
    simulated: int = 0
    busy_bound: float = 0.0
    first_step: float = 0.0
    order: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.step_time

    @property
    def gpu_hours_per_million(self) -> float:
        """GPU-hours to train on one million samples at this plan's throughput."""
        return self.gpus * 1e6 / self.samples_per_s / 3600.0

    @property
    def gpu_hours_per_million_bound(self) -> float:
        """The same at ``busy_bound`` (fill and drain hidden by the neighbouring steps)."""
        return self.gpus * 1e6 * self.busy_bound / self.num_samples / 3600.0

    def describe(self) -> str:
        """``name dp=.. tp=.. mbs=..`` for every section, on one line."""
        parts, done = [], set()
        for n, s in self.sections.items():
            rc = " rc" if s.recompute else ""
            if not s.group:
                parts.append(f"{n} {s.strategy_label()} mbs={s.micro_batch_size}{rc}")
            elif s.group not in done:
                done.add(s.group)
                mem = [(m, p) for m, p in self.sections.items() if p.group == s.group]
                inner = " ".join(
                    f"{m}:{p.micro_batch_size}{'rc' if p.recompute else ''}" for m, p in mem
                )
                parts.append(f"[{s.group}] {s.strategy_label()} mbs {inner}")
        return ("monolithic: " if self.monolithic else "") + ", ".join(parts)


__all__ = [
    "FSDP_CHOICES",
    "MBS_CHOICES",
    "MONOLITHIC_ORDERS",
    "TP_CHOICES",
    "Ablation",
    "Plan",
    "SearchOptions",
    "SectionPlan",
]
