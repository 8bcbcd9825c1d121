"""The emulated job: a paper-like scenario's sections as waits of the cost model's durations.

``maestro train CONFIG --emulate SCENARIO`` runs this job instead of the config's own, on the
config's layout. Everything but the arithmetic is real: the launcher, the scheduler, the
executor, every message (its header and ordering over gloo), FSDP2's all-gathers and
reduce-scatters, tensor parallelism's all-reduces, the gradient all-reduces and the
optimizer calls. Each section is a tiny transformer ``Block`` (so FSDP and TP apply to it
for real and keep replicas in lockstep the way they would), and each compute is replaced by
a wait of what the scenario's analytical GPU model (``maestro.sim.scenarios.SHAPES`` on a
GPU preset, with the layout priced by ``maestro.plan.tpmodel.LayoutCostModel``) says it
takes:

- a forward lasts ``forward_time`` of its micro-batch, a backward ``backward_time``
  (``_BackwardStart`` to ``_BackwardEnd``), counted from when it starts: the block's own
  CPU time and collectives are inside that wait, as kernel launches overlap a GPU's work
  (a forward starts after FSDP's all-gather, where replicas in lockstep meet); the
  optimizer step waits ``allreduce_time`` (``WaitOptimizer``: the gradient all-reduce and
  the optimizer, as the simulator prices a step's tail);
- an output is ready ``transfer_time`` after its producer's forward ends: each carries its
  ready time (``ready_us``) and the consumer waits for it (gradients flowing back are not
  delayed: at these message sizes the link time is microseconds);
- every step trains on the scenario's planned global batch (the batch the planner and the
  simulator price), so the measured step is comparable to the predicted one.

This is an emulation: no model runs and no GPU is involved. It shows what the runtime's own
orderings, waits and synchronisations do to a plan when the devices take the times the cost
model says, on any number of ranks a laptop can spawn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from maestro.costmodel import micro_batch_features

#: width and heads of an emulated section's block: heads divide every tp degree up to 8
DIM, HEADS = 64, 8


@dataclass
class Config:
    """``[workload]`` of an emulated run (``maestro.emulate.emulated_config`` writes it)."""

    scenario: str = "kd"
    """``kd``, ``mllm`` or ``mllm-audio``: the shapes and the synthetic batch."""
    gpu: str = "H100"
    """Analytical GPU preset the waits come from."""
    text_only: float = 0.4
    """Text-only share of the ``mllm`` batch."""
    batch_seed: int = 0
    """Seed of the scenario's synthetic batch (the planner's ``seed``)."""
    time_scale: float = 1.0
    """Every wait is multiplied by this (e.g. 0.1 for a quick check)."""
    colocated: bool = False
    """``--monolithic``: every section on every rank; outputs stay in memory (no transfer)."""

    def validate(self, where: str) -> None:
        from maestro.plan.workload import SCENARIOS

        if self.scenario not in SCENARIOS:
            raise ValueError(
                f"{where}.scenario: unknown scenario {self.scenario!r}; choose one of: "
                f"{', '.join(SCENARIOS)}"
            )
        if not self.time_scale > 0:
            raise ValueError(f"{where}.time_scale must be > 0, got {self.time_scale}")
        if not 0.0 <= self.text_only <= 1.0:
            raise ValueError(f"{where}.text_only must be in [0, 1], got {self.text_only}")


def scenario_samples(c: Config, num_samples: int):
    """The scenario's global batch of ``num_samples`` ``SampleInfo`` (the planner's)."""
    from maestro.plan.workload import _AUDIO_AT_40
    from maestro.sim.scenarios import kd_samples, mllm_samples

    if c.scenario == "kd":
        return kd_samples(num_samples, c.batch_seed)
    if c.scenario == "mllm":
        return mllm_samples(num_samples, c.text_only, 0.0, c.batch_seed)
    audio = _AUDIO_AT_40 * (1.0 - c.text_only) / 0.6
    return mllm_samples(num_samples, c.text_only, audio, c.batch_seed)


def layout_cost_model(c: Config, sections: dict):
    """The scenario's analytical model with each section's strategy from the run config
    (``sections``: name -> ``SectionConfig``): what the planner replays the layout on."""
    from maestro.costmodel import AnalyticalCostModel, preset
    from maestro.plan.tpmodel import SectionStrategy, with_layout
    from maestro.sim.scenarios import SHAPES

    base = AnalyticalCostModel({n: SHAPES[n] for n in sections}, gpu=preset(c.gpu))
    strategies = {
        n: SectionStrategy(
            tp=sc.tp,
            fsdp=sc.fsdp,
            zero=sc.zero,
            recompute=bool(sc.recompute) and not sc.frozen,
            reshard_after_forward=sc.reshard_after_forward,
            pp=sc.pp,
            pp_shared=sc.pp > 1,
        )
        for n, sc in sections.items()
    }
    return with_layout(base, strategies=strategies)


class _BackwardStart(torch.autograd.Function):
    """Identity on a section's output; its backward (the section's first) notes the time."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, clock: dict) -> torch.Tensor:
        ctx.clock = clock
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.clock["t0"] = time.time()
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on a section's input; its backward (the section's last) waits until the
    backward has lasted ``seconds`` since ``_BackwardStart`` (the emulated compute)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: dict, seconds: float) -> torch.Tensor:
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.seconds - (time.time() - ctx.clock.get("t0", time.time())))
        return grad, None, None


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def _sleep_until(t_us: int) -> None:
    _sleep(t_us / 1e6 - time.time())


class EmulatedModule(nn.Module):
    """A section stand-in: one small transformer ``Block`` (FSDP, TP and recompute apply to
    it as to a real section) on a ``(micro-batch, 1, DIM)`` input."""

    def __init__(self) -> None:
        super().__init__()
        from maestro.workloads.layers import Block

        self.base = nn.Parameter(torch.zeros(DIM))
        self.block = Block(DIM, HEADS, causal=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, DIM)
        return self.block(x + self.base)

    def emulated(self, x: torch.Tensor, clock: dict | None, bwd_s: float) -> torch.Tensor:
        """``forward`` with the backward's wait around the block (``clock`` None: frozen)."""
        x = x + self.base
        if clock is not None:
            x = _BackwardEnd.apply(x, clock, bwd_s)
        y = self.block(x)
        return y if clock is None else _BackwardStart.apply(y, clock)


class WaitOptimizer(torch.optim.Optimizer):
    """An optimizer whose step waits ``seconds`` (the emulated all-reduce and update) and
    changes nothing."""

    def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, seconds: float = 0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.seconds = float(seconds)

    @torch.no_grad()
    def step(self, closure=None):
        _sleep(self.seconds)
        return None


def _forward_fn(name: str, cm, c: Config, sink: bool, frozen: bool, same_node: bool):
    """The emulated section forward: wait for the inputs' transfers, run the block (its
    collectives), wait the forward's compute; outputs carry their ready time."""
    scale = c.time_scale

    def forward(module, samples, inputs):
        ready = [
            int(o["ready_us"]) for col in inputs.values() for o in col if o and "ready_us" in o
        ]
        if ready:
            _sleep_until(max(ready))
        feats = micro_batch_features([s["cost"] for s in samples])
        x = module.base.new_zeros(len(samples), 1, DIM)
        for col in inputs.values():
            for i, o in enumerate(col):
                if o is not None:  # gradients flow back to the producer through its output
                    x[i, 0] = x[i, 0] + o["h"].to(x.dtype)
        t0 = time.time()
        bwd = 0.0 if frozen else cm.backward_time(name, feats) * scale
        y = module.emulated(x, None if frozen else {}, bwd)
        _sleep(cm.forward_time(name, feats) * scale - (time.time() - t0))
        if sink:
            return [{"loss": y[i].float().square().mean()} for i in range(len(samples))]
        outs = [{"h": y[i, 0]} for i in range(len(samples))]
        if not c.colocated:
            t = time.time() + cm.transfer_time(name, feats, same_node) * scale
            for o in outs:
                o["ready_us"] = torch.tensor(int(t * 1e6), dtype=torch.int64)
        return outs

    return forward


def job(config):
    """The emulated ``maestro.Job`` of ``config.model`` (a ``Config``) on ``config``'s
    sections and layout."""
    from maestro.job import Job
    from maestro.sections import Section
    from maestro.sim.scenarios import SHAPES

    c: Config = config.model
    samples = scenario_samples(c, config.global_batch)
    names = {n for s in samples for n in s.sections}
    if set(config.sections) != names:
        raise ValueError(
            f"--emulate {c.scenario}: the config's sections {sorted(config.sections)} are not "
            f"the scenario's {sorted(names)}"
        )
    cm = layout_cost_model(c, config.sections)
    gpn = cm.gpu.gpus_per_node if hasattr(cm, "gpu") else 8
    # (not config.rank_layout(): that asks this job for its structure)
    ranks = sum(sc.dp * sc.fsdp * sc.tp for sc in config.sections.values())
    inputs = {n: tuple(p for p in _inputs_of(n) if p in config.sections) for n in config.sections}
    sinks = {n for n in config.sections if not any(n in ins for ins in inputs.values())}
    sections = []
    for n in _topo(inputs):
        frozen = bool(config.sections[n].frozen)
        fwd = _forward_fn(n, cm, c, n in sinks, frozen, same_node=ranks <= gpn)
        sections.append(
            Section(
                n,
                EmulatedModule,
                inputs=inputs[n],
                frozen=frozen,
                activates_on=lambda s, n=n: n in s["sections"],
                forward=fwd,
            )
        )
    assert all(n in SHAPES for n in config.sections)
    batch = [
        {"id": s.sample_id, "sections": tuple(sorted(s.sections)), "cost": dict(s.cost)}
        for s in samples
    ]
    return Job(
        sections,
        batches=lambda step: [dict(b) for b in batch],
        normaliser=len,
        sample_cost=lambda s: dict(s["cost"]),
        cost_model=cm,
    )


job.Config = Config


def _inputs_of(name: str) -> tuple[str, ...]:
    """The scenario's producers of ``name`` (the section graph of ``maestro.sim.scenarios``)."""
    return {"student": ("teacher",), "llm": ("vision", "audio")}.get(name, ())


def _topo(inputs: dict[str, tuple[str, ...]]) -> list[str]:
    order: list[str] = []
    while len(order) < len(inputs):
        for n, ins in inputs.items():
            if n not in order and all(p in order or p not in inputs for p in ins):
                order.append(n)
    return order
