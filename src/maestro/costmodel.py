"""Cost model: seconds per section micro-batch, per transfer and per gradient all-reduce.

The wavefront scheduler uses it to estimate when samples become ready and to balance replicas;
the simulator replays schedules on it; the planner (``maestro.plan``) can reuse both. Two
implementations share the ``CostModel`` interface:

- ``AnalyticalCostModel``: FLOPs and bytes from each section's transformer shape on a GPU preset
  (``GPU_PRESETS``: H100, H200 bf16), with an efficiency curve that falls for small micro-batches.
- ``MeasuredCostModel``: linear fits (non-negative least squares) to a JSON profile measured on
  this machine.

A micro-batch is described by its *features* (``micro_batch_features``): ``samples`` plus the sum
of every cost key of its samples (``tokens``, ``images``, ...), ``tokens_sq`` (sum of squared
per-sample token counts, for attention) and ``tokens_padded`` (samples times the longest).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

Features = Mapping[str, float]


def micro_batch_features(costs: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Sum per-sample cost dicts into micro-batch features.

    Args:
        costs: the ``SampleInfo.cost`` of every sample in the micro-batch.

    Returns:
        ``{"samples": n, "tokens_sq": sum(t**2), "tokens_padded": n * max(t), key: sum(value)
        for every cost key}``, ``t`` each sample's ``tokens``. ``tokens_padded`` is what a
        micro-batch padded to its longest sample computes (``workloads.layers.pad_stack``):
        with long-tailed lengths it grows faster than ``tokens`` with the micro-batch size.
    """
    out: dict[str, float] = {"samples": 0.0, "tokens_sq": 0.0}
    longest = 0.0
    for c in costs:
        out["samples"] += 1.0
        for k, v in c.items():
            out[k] = out.get(k, 0.0) + v
        t = c.get("tokens", 0.0)
        out["tokens_sq"] += t * t
        longest = max(longest, t)
    out[PADDED] = out["samples"] * longest
    return out


#: the ``micro_batch_features`` key of padded positions (derived, not a per-sample cost)
PADDED = "tokens_padded"
#: derived features that are not per-sample costs to add up (a unit cost skips them)
DERIVED = ("tokens_sq", PADDED)


class CostModel:
    """Interface: every time is in seconds. Subclasses implement the four methods.

    ``whole_model``: a ``WholeModelFit`` of the monolithic runtime's whole-model micro-batch,
    when the model has one (``MeasuredCostModel`` fitted from monolithic runs); the simulator
    then prices colocated (monolithic) schedules with it instead of the sum of the sections.
    """

    whole_model: WholeModelFit | None = None

    def forward_time(self, section: str, feats: Features) -> float:
        """Forward of one micro-batch with features ``feats`` on one replica of ``section``."""
        raise NotImplementedError

    def backward_time(self, section: str, feats: Features) -> float:
        """Backward (including recompute, if any) of the same micro-batch."""
        raise NotImplementedError

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        """Sending ``producer``'s outputs (or their gradients) for samples with ``feats``.

        Args:
            producer: the section whose per-sample outputs are sent.
            feats: features of the samples in the (coalesced) message.
            same_node: sender and receiver share a node (NVLink/shared memory) or not.
        """
        raise NotImplementedError

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        """Gradient all-reduce plus optimizer step of ``section`` over ``dp`` replicas."""
        raise NotImplementedError

    def lockstep(self, section: str) -> int:
        """``k > 1``: the replicas of ``section`` run in step within shard groups of ``k``
        consecutive ones (FSDP's all-gathers and reduce-scatters; HSDP's all-reduce across
        groups is once per step, in ``allreduce_time``), and every replica of a group runs
        as many micro-batches as the group's busiest (padded). ``0`` (default): replicas are
        independent (``maestro.plan.tpmodel.LayoutCostModel`` says ``fsdp`` for FSDP). The
        simulator applies the same rule to every layout (``schedule.timeline``)."""
        return 0


class UnitCostModel(CostModel):
    """The default when no cost model is given: one unit per sample plus its cost features.

    Forward costs ``samples + sum(cost values)``; backward twice that; transfers and
    all-reduces are free. Enough for schedulers to balance by cost rather than count.
    """

    def forward_time(self, section: str, feats: Features) -> float:
        return sum(v for k, v in feats.items() if k not in DERIVED)

    def backward_time(self, section: str, feats: Features) -> float:
        return 2.0 * self.forward_time(section, feats)

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        return 0.0

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        return 0.0


# ---------------------------------------------------------------------------------------------
# Analytical model


@dataclass(frozen=True)
class GPUPreset:
    """Peak figures of one accelerator and its links (dense bf16; vendor data sheets).

    Args:
        name: preset name.
        flops: dense bf16 FLOP/s of one GPU.
        hbm_bw: HBM bandwidth, bytes/s.
        memory: HBM capacity, bytes.
        nvlink_bw: NVLink bandwidth per GPU and direction, bytes/s.
        net_bw: inter-node bandwidth per GPU (one NIC per GPU), bytes/s.
        gpus_per_node: GPUs that share an NVLink domain.
        link_latency: per-message latency, seconds (same for both link kinds, as a floor).
        mfu_max: best fraction of ``flops`` a large matmul-bound micro-batch reaches.
        half_tokens: micro-batch size in tokens at which efficiency is half of ``mfu_max``
            (small micro-batches cannot fill the GPU).
        layer_overhead: fixed seconds per layer and pass (kernel launches, norms, small ops).
        hardware: the ``maestro.estimate.hardware`` preset the analytical model prices with
            (``mfu_max``, ``half_tokens`` and ``layer_overhead`` are no longer used by it).
    """

    name: str
    flops: float
    hbm_bw: float
    memory: float
    nvlink_bw: float
    net_bw: float
    gpus_per_node: int = 8
    link_latency: float = 10e-6
    mfu_max: float = 0.55
    half_tokens: float = 128.0
    layer_overhead: float = 60e-6
    hardware: str = "h100-sxm"


#: H100 SXM5 and H200 SXM: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s (80 GB) / HBM3e 4.8 TB/s
#: (141 GB), NVLink 4 at 900 GB/s total (450 GB/s per direction), one 400 Gb/s NIC per GPU.
#: A100 SXM4 80 GB (for checking the model against published Megatron-LM figures, which are
#: A100 runs): 312 TFLOP/s dense bf16, HBM2e 2.0 TB/s, NVLink 3 at 600 GB/s total (300 GB/s
#: per direction), one 200 Gb/s HDR NIC per GPU.
GPU_PRESETS: dict[str, GPUPreset] = {
    "H100": GPUPreset("H100", 989e12, 3.35e12, 80e9, 450e9, 50e9, hardware="h100-sxm"),
    "H200": GPUPreset("H200", 989e12, 4.8e12, 141e9, 450e9, 50e9, hardware="h200"),
    "A100": GPUPreset("A100", 312e12, 2.0e12, 80e9, 300e9, 25e9, hardware="a100-80g"),
    # torchtitan's published runs' part (maestro.estimate.hardware "h100-96g-500w")
    "H100-96G-500W": GPUPreset(
        "H100-96G-500W", 909e12, 2.4e12, 95 * 2**30, 450e9, 50e9, hardware="h100-96g-500w"
    ),
}


@dataclass(frozen=True)
class SectionShape:
    """A transformer-like section for the analytical model.

    Args:
        layers: number of transformer blocks.
        hidden: model width ``d``.
        ffn_hidden: MLP inner width (default ``4 * hidden``).
        vocab: output vocabulary (LM head); 0 for an encoder.
        unit: the sample cost key counting this section's inputs: ``"tokens"`` (sequence length,
            attention over the whole sample) or e.g. ``"images"`` (each unit attends within
            itself).
        tokens_per_unit: sequence positions per unit (e.g. 256 patches per image).
        out_bytes_per_unit: bytes of output sent to each consumer per unit (hidden states,
            logits); the same bytes come back as gradients.
        recompute: backward recomputes the forward (activation checkpointing per block, the
            runtime's ``recompute``: the estimate's ``full`` policy).
        tp_plan: the runtime can split the section's blocks tensor-parallel
            (``maestro.parallel.tp.tp_refusal``); ``False``: planners keep it at ``tp = 1``.
        heads: attention heads (default ``hidden // 128``).
        kv_heads: key/value heads (default ``heads``).
        gated: SwiGLU MLP (three ``d x ffn`` matrices) instead of two.
        sq_key: a cost key holding the sum of squared lengths of the units' own sequences
            (e.g. ``"vision_sq"`` for images of varying token counts); attention pairs come
            from it instead of ``units * tokens_per_unit ** 2``.
    """

    layers: int
    hidden: int
    ffn_hidden: int = 0
    vocab: int = 0
    unit: str = "tokens"
    tokens_per_unit: float = 1.0
    out_bytes_per_unit: float = 0.0
    recompute: bool = False
    tp_plan: bool = True
    heads: int = 0
    kv_heads: int = 0
    gated: bool = False
    sq_key: str = ""

    @functools.cached_property
    def spec(self):
        """The block structure as ``maestro.estimate.ModelSpec`` (what the kernels price)."""
        from maestro.estimate.models import ModelSpec

        heads = self.heads or max(1, self.hidden // 128)
        return ModelSpec(
            "section",
            self.layers,
            self.hidden,
            heads,
            self.kv_heads or heads,
            self.ffn_hidden or 4 * self.hidden,
            self.vocab,
            gated=self.gated,
            causal=self.unit == "tokens",
            tied=False,
            head_dim=self.hidden // heads if self.hidden % heads == 0 else 0,
        )

    @functools.cached_property
    def params(self) -> float:
        """Parameter count: the blocks' attention and MLP weights, plus the LM head."""
        sp = self.spec
        return sp.layers * sp.layer_params + sp.head_params

    @property
    def state_params(self) -> float:
        """Parameters held in memory and reduced: ``params`` plus the input embedding (a
        lookup, no GEMM, so not in ``params``' FLOPs)."""
        return self.params + self.spec.embedding_params

    def positions(self, feats: Features) -> float:
        """Sequence positions in a micro-batch (without padding)."""
        return feats.get(self.unit, 0.0) * self.tokens_per_unit

    def computed_positions(self, feats: Features) -> float:
        """Positions the blocks compute on: the micro-batch's samples packed (variable-length
        flash attention, as GPU trainers run them), for every layout alike. (The CPU
        runtime pads to the longest sample; measured models price that, ``tokens_padded``.)"""
        return self.positions(feats)

    def attention(self, feats: Features) -> tuple[float, float]:
        """``(query-key pairs, token-weighted mean sequence length)`` of a micro-batch."""
        pos = self.positions(feats)
        if pos <= 0:
            return 0.0, 0.0
        if self.unit == "tokens":
            sq = feats.get("tokens_sq", pos * pos / max(feats.get("samples", 1.0), 1.0))
            return (sq + pos) / 2.0, sq / pos
        if self.sq_key:
            sq = feats.get(self.sq_key, 0.0)
        else:  # each unit attends within itself
            sq = feats.get(self.unit, 0.0) * self.tokens_per_unit**2
        return sq, sq / pos

    def forward_flops(self, feats: Features) -> float:
        """Matmul FLOPs of one forward: ``2 * params * positions`` plus attention scores."""
        pairs, _ = self.attention(feats)
        return 2.0 * self.params * self.computed_positions(feats) + 4.0 * self.layers * (
            self.spec.q_dim * pairs
        )


def _kernel_pass(spec, pos, pairs, mean_len, tp, policy, hw, kernels, eff) -> tuple[float, float]:
    """``maestro.estimate``'s blocks and head for one micro-batch."""
    from maestro.estimate.kernels import head_cost, layer_cost

    lc = layer_cost(spec, pos, pairs, mean_len, tp, policy, hw, kernels, eff)
    hf, hb = head_cost(spec, pos, tp, hw, kernels, eff)
    return spec.layers * lc.fwd + hf, spec.layers * lc.bwd + hb


@dataclass
class AnalyticalCostModel(CostModel):
    """Sections' transformer shapes priced by ``maestro.estimate``'s kernels on a GPU preset:
    the same GEMM, attention, elementwise and memory model as ``maestro estimate``.

    Args:
        shapes: section name -> ``SectionShape``.
        gpu: the accelerator preset (mapped to ``maestro.estimate.hardware``).
        efficiency: multiplies the framework's kernel efficiency (1.0: as calibrated).
        grad_bytes: bytes per gradient element in the all-reduce / reduce-scatter (4: fp32,
            FSDP2's ``reduce_dtype`` in torchtitan).
        optim_bytes: unused (kept for old callers; the optimizer step reads and writes 30
            bytes per parameter, ``maestro.estimate.step``).
        framework: how the sections run (``maestro.estimate.framework``; ``torchtitan``:
            PyTorch eager, what ``maestro train`` runs).
    """

    shapes: dict[str, SectionShape]
    gpu: GPUPreset = field(default_factory=lambda: GPU_PRESETS["H100"])
    efficiency: float = 1.0
    grad_bytes: float = 4.0
    optim_bytes: float = 16.0
    framework: str = "torchtitan"

    def _shape(self, section: str) -> SectionShape:
        try:
            return self.shapes[section]
        except KeyError:
            raise ValueError(f"cost model has no shape for section {section!r}") from None

    def __post_init__(self) -> None:
        from maestro.estimate.framework import framework
        from maestro.estimate.hardware import hardware

        # looked up once, and each micro-batch priced once: the planner prices millions
        # (a (section, tp, positions, pairs, recompute) key fixes the rest: shapes are per
        # instance, and the layout copies that differ only in recompute share the cache,
        # ``maestro.plan.tpmodel.with_layout``)
        self._hw = hardware(self.gpu.hardware)
        self._fw = framework(self.framework)
        self._cache: dict[tuple, tuple[float, float]] = {}

    @property
    def hw(self):
        """The ``maestro.estimate.hardware.Hardware`` of ``gpu``."""
        return self._hw

    @property
    def fw(self):
        """The ``maestro.estimate.framework.Framework`` the sections run on."""
        return self._fw

    def pass_times(self, section: str, feats: Features, tp: int = 1) -> tuple[float, float]:
        """``(forward, backward)`` compute seconds of one micro-batch on one GPU of a ``tp``
        group (collectives apart; backward includes recompute)."""
        if feats.get("samples", 0.0) <= 0:
            return 0.0, 0.0
        shape = self._shape(section)
        pos = shape.computed_positions(feats)
        if pos <= 0:
            return 0.0, 0.0
        pairs, mean_len = shape.attention(feats)
        key = (section, tp, pos, pairs, shape.recompute)
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) > 1 << 20:  # bounded: about 200 MB at most
                self._cache.clear()
            fw = self._fw
            got = self._cache[key] = _kernel_pass(
                shape.spec,
                pos,
                pairs,
                mean_len,
                tp,
                "full" if shape.recompute else "none",
                self._hw,
                fw.kernels,
                fw.kernel_efficiency * self.efficiency,
            )
        return got

    def forward_time(self, section: str, feats: Features) -> float:
        return self.pass_times(section, feats)[0]

    def backward_time(self, section: str, feats: Features) -> float:
        return self.pass_times(section, feats)[1]

    def state_bytes(self, section: str, trainable: bool) -> float:
        """Parameters, gradients and optimizer state of one unsharded replica: bf16 weights
        (2 bytes per parameter) for a frozen section; fp32 master weights, gradients and
        Adam moments plus the bf16 compute copy (18) for a trainable one."""
        return (18.0 if trainable else 2.0) * self._shape(section).state_params

    def memory_bytes(self, section: str, feats: Features, trainable: bool) -> float:
        """Peak bytes on one replica running a micro-batch with ``feats`` (for planners).

        ``state_bytes``, the activations ``maestro.estimate.kernels.activation_bytes``
        counts per position and block (every block's under no recompute, the block inputs
        plus one block's under ``recompute``; one block's for a frozen section), the logits
        alive at the loss (bf16 logits for a frozen section), and the allocator's headroom.
        """
        from maestro.estimate.kernels import activation_bytes

        shape = self._shape(section)
        spec, k = shape.spec, self.fw.kernels
        pos = shape.computed_positions(feats)
        one = activation_bytes(spec, "none", k) * pos
        if not trainable:
            acts = one
            logits = 2.0 * pos * spec.vocab
        elif shape.recompute:
            acts = spec.layers * activation_bytes(spec, "full", k) * pos + one
            logits = k.logit_bytes * pos * spec.vocab
        else:
            acts = spec.layers * one
            logits = k.logit_bytes * pos * spec.vocab
        live = self.state_bytes(section, trainable) + acts + logits
        return live * (1.0 + self.fw.allocator_headroom)

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        shape = self._shape(producer)
        nbytes = feats.get(shape.unit, 0.0) * shape.out_bytes_per_unit
        if nbytes <= 0:
            return 0.0
        hw = self.hw
        bw = hw.nvlink_bw * hw.nvlink_eff if same_node else hw.net_bw * hw.net_eff
        return hw.link_latency + nbytes / bw

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        """Gradient all-reduce over ``dp`` replicas plus the Adam step of a ``1/dp`` shard
        (30 bytes per parameter read and written, as ``maestro.estimate.step``)."""
        from maestro.estimate.step import ring_time

        shape = self._shape(section)
        hw = self.hw
        optim = 30.0 * shape.state_params / (hw.hbm_bw * hw.hbm_eff) / max(dp, 1)
        if dp <= 1:
            return optim
        grads = shape.state_params * self.grad_bytes
        return 2.0 * ring_time(grads, dp, hw, same_node) + optim


# ---------------------------------------------------------------------------------------------
# Section structure, for parallel layouts


@dataclass(frozen=True)
class SectionFacts:
    """What a parallel layout's cost depends on besides measured times: a section's structure.

    ``maestro.plan.tpmodel.LayoutCostModel`` prices FSDP all-gathers and reduce-scatters and
    tensor-parallel all-reduces from these; an ``AnalyticalCostModel`` derives them from its
    ``SectionShape`` (``facts_of``), a measured model carries them (``MeasuredCostModel.facts``,
    counted on the run config's modules built on the ``meta`` device).

    Args:
        blocks: transformer blocks (FSDP units besides the root; TP splits each).
        hidden: block width (bytes of one TP all-reduce: positions x hidden x ``act_bytes``).
        param_bytes: bytes of all the section's parameters as FSDP gathers them.
        grad_bytes: bytes of its gradients as FSDP reduce-scatters them (0: frozen).
        block_fraction: share of the section's compute (and parameters) inside the blocks:
            what TP divides and recompute repeats.
        heads: attention heads per block (TP degrees must divide it; 0: no constraint).
        act_bytes: bytes per activation element.
        state_bytes: bytes of parameters, gradients and optimizer state of one unsharded
            replica (memory of a measured model; 0: unknown).
        tp_plan: the runtime can split the blocks tensor-parallel
            (``maestro.parallel.tp.tp_refusal`` finds no reason not to); ``False``: the
            section runs at ``tp = 1`` only.
    """

    blocks: int
    hidden: int
    param_bytes: float
    grad_bytes: float = 0.0
    block_fraction: float = 1.0
    heads: int = 0
    act_bytes: float = 2.0
    state_bytes: float = 0.0
    tp_plan: bool = True


def facts_of(cost_model: CostModel, section: str) -> SectionFacts | None:
    """The ``SectionFacts`` of ``section`` under ``cost_model`` (``None``: unknown).

    An ``AnalyticalCostModel`` derives them from the shape (bf16 weights and activations,
    ``grad_bytes`` per gradient); any other model returns its own ``facts`` entry.
    """
    if isinstance(cost_model, AnalyticalCostModel):
        sh = cost_model._shape(section)
        per_block = sh.spec.layer_params
        return SectionFacts(
            blocks=sh.layers,
            hidden=sh.hidden,
            param_bytes=2.0 * sh.state_params,
            grad_bytes=cost_model.grad_bytes * sh.state_params,
            block_fraction=sh.layers * per_block / sh.state_params if sh.params else 1.0,
            act_bytes=2.0,
            state_bytes=18.0 * sh.state_params,
            tp_plan=sh.tp_plan,
            heads=sh.spec.heads,
        )
    return getattr(cost_model, "facts", {}).get(section)


def splits_tp(cost_model: CostModel, section: str) -> bool:
    """Whether ``section`` may run at ``tp > 1`` under ``cost_model``: its structure is known
    (``facts_of``) and the runtime has a tensor-parallel plan for it (``tp_plan``)."""
    facts = facts_of(cost_model, section)
    return facts is not None and facts.tp_plan


# ---------------------------------------------------------------------------------------------
# Measured model


@dataclass
class LinearFit:
    """``time = sum(coef[k] * feats[k])`` with ``feats["const"] = 1``; coefficients >= 0."""

    coef: dict[str, float]

    def __call__(self, feats: Features) -> float:
        if feats.get("samples", 0.0) <= 0:
            return 0.0
        return sum(c * (1.0 if k == "const" else feats.get(k, 0.0)) for k, c in self.coef.items())

    @classmethod
    def fit(cls, rows: list[tuple[Mapping[str, float], float]], keys: list[str]) -> LinearFit:
        """Non-negative least squares of ``time`` on ``["const", *keys]``.

        Args:
            rows: ``(features, seconds)`` measurements.
            keys: feature names to use besides the constant.
        """
        import numpy as np
        from scipy.optimize import nnls

        cols = ["const", *keys]
        a = np.array([[1.0 if k == "const" else f.get(k, 0.0) for k in cols] for f, _ in rows])
        b = np.array([t for _, t in rows])
        # scale columns so nnls is well conditioned across features of very different sizes
        scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
        x, _ = nnls(a / scale, b)
        return cls({k: float(v / s) for k, v, s in zip(cols, x, scale)})


@dataclass
class WholeModelFit:
    """The monolithic runtime's costs, fitted from its traced runs (``maestro.sim.calibrate``).

    A monolithic rank runs every section on each micro-batch (``runtime/monolithic.py``):
    its Python, stacking and dispatch per micro-batch differ from a section rank's (no
    messages), so they are fitted on their own rather than summed from the sections' fits.
    Times are measured with every rank of the traced run computing at once, i.e. under the
    machine's contention at that world size; they are used as they are.

    Args:
        forward: fit of one whole-model micro-batch's forward seconds on the features of all
            its samples (``micro_batch_features``).
        forward_backward: the same for forward plus backward.
        optimizer_s: seconds per step after the last backward besides the gradient
            all-reduce (the non-finite guard, the optimizer step, Python).
        allreduce_s: world size -> measured seconds of the fused gradient all-reduce.
        grad_bytes: bytes of all trainable gradients (the all-reduce at other world sizes:
            a ring over ``link_bw``).
        link_bw: bytes/s between processes.
        link_latency: seconds per message.
        step_overhead: seconds per step outside micro-batches (building the batch, the
            gaps between steps).
        max_samples: the largest micro-batch the fit saw (0: unknown).
    """

    forward: LinearFit
    forward_backward: LinearFit
    optimizer_s: float = 0.0
    allreduce_s: dict[int, float] = field(default_factory=dict)
    grad_bytes: float = 0.0
    link_bw: float = 2e9
    link_latency: float = 50e-6
    step_overhead: float = 0.0
    max_samples: float = 0.0

    def times(self, feats: Features) -> tuple[float, float]:
        """``(forward, backward)`` seconds of one whole-model micro-batch."""
        f = max(0.0, self.forward(feats))
        return f, max(0.0, self.forward_backward(feats) - f)

    def tail(self, dp: int) -> float:
        """Seconds from the last backward to the step's end on ``dp`` ranks."""
        if dp in self.allreduce_s:
            return self.optimizer_s + self.allreduce_s[dp]
        if dp <= 1:
            return self.optimizer_s
        ring = 2.0 * (dp - 1) / dp * self.grad_bytes / self.link_bw
        return self.optimizer_s + ring + 2 * (dp - 1) * self.link_latency

    @classmethod
    def from_record(cls, rec: Mapping, link_bw: float, link_latency: float) -> WholeModelFit:
        """From a profile's ``"monolithic"`` record (``rows`` as a section's, ``optimizer_s``,
        ``allreduce_s`` keyed by world size, ``param_bytes``, ``step_overhead_s``,
        ``max_micro_batch``)."""
        rows = rec.get("rows", [])
        if len(rows) < 2 or any(r.get("forward_backward_s") is None for r in rows):
            raise ValueError("profile 'monolithic' needs 2 or more rows with forward_backward_s")
        keys = _varying_keys(rows)
        return cls(
            forward=LinearFit.fit([(r["features"], r["forward_s"]) for r in rows], keys),
            forward_backward=LinearFit.fit(
                [(r["features"], r["forward_backward_s"]) for r in rows], keys
            ),
            optimizer_s=float(rec.get("optimizer_s", 0.0)),
            allreduce_s={int(k): float(v) for k, v in rec.get("allreduce_s", {}).items()},
            grad_bytes=float(rec.get("param_bytes", 0.0)),
            link_bw=link_bw,
            link_latency=link_latency,
            step_overhead=float(rec.get("step_overhead_s", 0.0)),
            max_samples=float(rec.get("max_micro_batch", 0.0)),
        )


def _varying_keys(rows: list[Mapping]) -> list[str]:
    """Feature names that vary across profile rows (a constant one is the fit's ``const``)."""
    first = rows[0]["features"]
    return sorted(
        {k for r in rows for k in r["features"]}
        - {k for k in first if all(r["features"].get(k) == first[k] for r in rows)}
    )


@dataclass
class MeasuredCostModel(CostModel):
    """Linear fits of measured forward and forward+backward times, per section.

    Args:
        forward: section -> fit of forward seconds.
        forward_backward: section -> fit of forward+backward seconds (backward = difference).
        bytes_per: section -> {feature: output bytes per unit of that feature}.
        param_bytes: section -> bytes of gradients all-reduced each step.
        link_bw: bytes/s between processes (measured or assumed), both for transfers and
            all-reduce.
        link_latency: seconds per message.
        optimizer_s: section -> seconds of one optimizer step.
        step_overhead: seconds every rank spends per step outside sections (building the
            global batch); the simulator adds it to the step time.
        max_samples: section -> the largest micro-batch the profile measured (its
            ``max_micro_batch``; the fit is not valid beyond it, so the planner does not pick
            larger micro-batches); absent when the profile does not say.
        contention: slowdown of a section's compute per other rank computing meanwhile
            (fitted from real runs; ``maestro.sim.replay`` applies it); 0 for an isolated
            profile.
        scheduler_s: seconds the scheduler takes per step on every rank (measured in real
            runs; ``maestro.sim.replay`` adds it to a section layout's step).
        whole_model: the monolithic runtime's own fit (see ``WholeModelFit``), when the
            profile has one.
        step_scale: layout kind (``"sections"``, ``"monolithic"``) -> measured over
            replayed step time of the profiling runs (``maestro.sim.calibrate``): a
            step-level correction ``maestro.sim.replay`` applies for what it does not model;
            empty for an isolated profile.
        step_scale_by_mbs: layout kind -> {micro-batch size of the profiling run:
            its measured over replayed step time}; when present, ``step_factor`` uses it in
            place of ``step_scale`` (the unmodelled waits of a section pipeline shrink as its
            micro-batches grow: fewer, larger messages).
    """

    forward: dict[str, LinearFit]
    forward_backward: dict[str, LinearFit]
    bytes_per: dict[str, dict[str, float]] = field(default_factory=dict)
    param_bytes: dict[str, float] = field(default_factory=dict)
    link_bw: float = 2e9
    link_latency: float = 50e-6
    optimizer_s: dict[str, float] = field(default_factory=dict)
    step_overhead: float = 0.0
    max_samples: dict[str, float] = field(default_factory=dict)
    contention: float = 0.0
    scheduler_s: float = 0.0
    whole_model: WholeModelFit | None = None
    step_scale: dict[str, float] = field(default_factory=dict)
    step_scale_by_mbs: dict[str, dict[int, float]] = field(default_factory=dict)
    facts: dict[str, SectionFacts] = field(default_factory=dict)
    """Section -> its structure (``SectionFacts``), for pricing parallel layouts; filled by
    the planner from the run config (``maestro.plan.workload``), not stored in profiles."""

    def step_factor(self, kind: str, micro_batch: int) -> float:
        """The step-level correction of a ``kind`` layout (``"sections"`` or ``"monolithic"``)
        keyed by ``micro_batch`` samples (``maestro.sim.replay.correction_micro_batch``):
        ``step_scale_by_mbs`` interpolated linearly in log2 of the size between the measured
        sizes (clamped to the nearest outside them), else ``step_scale[kind]``, else 1."""
        table = self.step_scale_by_mbs.get(kind)
        if not table:
            return self.step_scale.get(kind, 1.0)
        sizes = sorted(table)
        m = max(float(micro_batch), 1.0)
        if m <= sizes[0]:
            return table[sizes[0]]
        if m >= sizes[-1]:
            return table[sizes[-1]]
        hi = next(k for k in sizes if k >= m)
        lo = max(k for k in sizes if k < m)
        w = (math.log2(m) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return (1.0 - w) * table[lo] + w * table[hi]

    def forward_time(self, section: str, feats: Features) -> float:
        try:
            return max(0.0, self.forward[section](feats))
        except KeyError:
            raise ValueError(f"profile has no section {section!r}") from None

    def backward_time(self, section: str, feats: Features) -> float:
        if section not in self.forward_backward:
            raise ValueError(f"profile has no backward for section {section!r}")
        return max(0.0, self.forward_backward[section](feats) - self.forward_time(section, feats))

    def transfer_time(self, producer: str, feats: Features, same_node: bool) -> float:
        per = self.bytes_per.get(producer, {})
        nbytes = sum(v * feats.get(k, 0.0) for k, v in per.items())
        return self.link_latency + nbytes / self.link_bw if nbytes > 0 else 0.0

    def allreduce_time(self, section: str, dp: int, same_node: bool) -> float:
        optim = self.optimizer_s.get(section, 0.0)
        if dp <= 1:
            return optim
        nbytes = self.param_bytes.get(section, 0.0)
        ring = 2.0 * (dp - 1) / dp * nbytes / self.link_bw + 2 * (dp - 1) * self.link_latency
        return ring + optim

    @classmethod
    def from_profile(cls, profile: Mapping | str | Path) -> MeasuredCostModel:
        """Fit from a profile dict or JSON file.

        The profile has ``{"sections": {name: {"rows": [{"features": {...}, "forward_s": x,
        "forward_backward_s": y (optional)}, ...], "bytes_per": {...}, "param_bytes": n,
        "optimizer_s": t, "max_micro_batch": m (optional)}}, "link_bw": ..., "link_latency":
        ..., "step_overhead_s": t}``, and optionally ``"contention"``, ``"scheduler_s"``,
        ``"step_scale"``, ``"step_scale_by_mbs"`` and a ``"monolithic"`` record
        (``WholeModelFit.from_record``), as profiles fitted from real runs have
        (``maestro.sim.calibrate``). Features used for
        the fit are those that vary across the section's rows.
        """
        if not isinstance(profile, Mapping):
            path = Path(profile)
            if not path.exists():
                raise FileNotFoundError(f"profile {path} does not exist")
            profile = json.loads(path.read_text())
        secs = profile.get("sections")
        if not secs:
            raise ValueError("profile has no 'sections'")
        fwd, fb, bytes_per, params, optim = {}, {}, {}, {}, {}
        for name, rec in secs.items():
            rows = rec.get("rows", [])
            if len(rows) < 2:
                raise ValueError(f"profile section {name!r} needs at least 2 measured rows")
            keys = _varying_keys(rows)
            fwd[name] = LinearFit.fit([(r["features"], r["forward_s"]) for r in rows], keys)
            fb_rows = [
                (r["features"], r["forward_backward_s"])
                for r in rows
                if r.get("forward_backward_s") is not None
            ]
            if fb_rows:
                fb[name] = LinearFit.fit(fb_rows, keys)
            bytes_per[name] = dict(rec.get("bytes_per", {}))
            params[name] = float(rec.get("param_bytes", 0.0))
            optim[name] = float(rec.get("optimizer_s", 0.0))
        link_bw = float(profile.get("link_bw", 2e9))
        link_latency = float(profile.get("link_latency", 50e-6))
        whole = profile.get("monolithic")
        return cls(
            forward=fwd,
            forward_backward=fb,
            bytes_per=bytes_per,
            param_bytes=params,
            link_bw=link_bw,
            link_latency=link_latency,
            optimizer_s=optim,
            step_overhead=float(profile.get("step_overhead_s", 0.0)),
            max_samples={
                name: float(rec["max_micro_batch"])
                for name, rec in secs.items()
                if rec.get("max_micro_batch")
            },
            contention=float(profile.get("contention", 0.0)),
            scheduler_s=float(profile.get("scheduler_s", 0.0)),
            whole_model=(
                WholeModelFit.from_record(whole, link_bw, link_latency) if whole else None
            ),
            step_scale={k: float(v) for k, v in profile.get("step_scale", {}).items()},
            step_scale_by_mbs={
                kind: {int(m): float(v) for m, v in table.items()}
                for kind, table in profile.get("step_scale_by_mbs", {}).items()
            },
        )


def preset(name: str) -> GPUPreset:
    """The GPU preset called ``name`` (case-insensitive); ``ValueError`` lists the known ones."""
    key = name.upper()
    key = {"H100-SXM": "H100", "A100-80G": "A100"}.get(key, key)
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU preset {name!r}; choose one of: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]


__all__ = [
    "GPU_PRESETS",
    "AnalyticalCostModel",
    "CostModel",
    "GPUPreset",
    "LinearFit",
    "MeasuredCostModel",
    "SectionFacts",
    "SectionShape",
    "UnitCostModel",
    "WholeModelFit",
    "facts_of",
    "micro_batch_features",
    "preset",
    "splits_tp",
]
