"""Run configuration: dataclasses with a docstring per field, loaded from TOML and validated.

A config file names the workload and its model sizes, one ``[sections.NAME]`` table per section
(its ``dp``, ``micro_batch_size``, ``frozen``, optimizer and learning rate), the global batch,
the number of steps and the seed. Mistakes raise ``ValueError`` naming the field. This module
does not import torch so ``maestro plan``/``simulate`` stay cheap.

Example (``examples/kd.toml``)::

    global_batch = 16
    steps = 20
    [workload]
    name = "kd"
    [sections.teacher]
    dp = 1
    micro_batch_size = 8
    frozen = true
    [sections.student]
    dp = 1
    micro_batch_size = 2
    lr = 1e-3
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maestro.schedule.types import SectionSpec
from maestro.sections import topological_order

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: short optimizer names; any other ``torch.optim`` class name (``"Adam"``, ``"RMSprop"``) or
#: ``"package.module:Class"`` works too
OPTIMIZERS = ("sgd", "adamw")
DTYPES = ("float32", "float64", "bfloat16")
LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class SectionConfig:
    """Resources and training settings of one section."""

    dp: int = 1
    """Data-parallel replicas: this many disjoint ranks run the section (>= 1)."""
    micro_batch_size: int = 1
    """At most this many samples per micro-batch on each replica (>= 1)."""
    frozen: bool | None = None
    """Forward-only: no gradients, no optimizer, no activations kept (e.g. a KD teacher).
    Unset: as the job's section says (``Section(frozen=...)``; trainable for the built-ins)."""
    optimizer: str | None = None
    """``"adamw"`` (default for a trainable section), ``"sgd"``, any ``torch.optim`` class
    name (``"Adam"``, ``"RMSprop"``, ...) or ``"package.module:Class"`` for one of your own
    (called as ``Class(params, lr=..., weight_decay=..., **optimizer_args)``). A frozen
    section must not set one."""
    lr: float = 1e-3
    """Peak learning rate of this section's optimizer (> 0)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD), >= 0."""
    optimizer_args: dict = field(default_factory=dict)
    """Further keyword arguments of the optimizer, e.g. ``{ betas = [0.9, 0.95], eps = 1e-8 }``
    (lists become tuples)."""
    lr_schedule: str = "constant"
    """``"constant"``, ``"cosine"`` (to ``min_lr_ratio * lr`` at the last step) or
    ``"linear"`` (likewise), each after ``warmup_steps`` of linear warmup from 0."""
    warmup_steps: int = 0
    """Steps of linear warmup at the start of the schedule (>= 0)."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear decay, as a fraction of ``lr`` (0..1)."""
    grad_clip: float | None = None
    """Clip this section's gradients to this global L2 norm (over its whole data-parallel
    group, after the gradient reduction) before each optimizer step; ``None``: no clipping."""
    inputs: list[str] | None = None
    """Producer sections this one reads; ``None`` keeps the workload's wiring."""
    token_budget: int | None = None
    """Optional cap on tokens per micro-batch, passed to schedulers that honour it."""
    max_in_flight: int | None = None
    """Frozen sections only: at most this many output messages (one per micro-batch and
    consumer replica) may be sent and not yet received; before its next forward the section
    waits until fewer are in flight. A forward-only section runs ahead of its consumers, and
    its unreceived outputs stay in memory: this bounds that memory. ``None``: unbounded (it
    is still at most one step ahead). ``0``: no run-ahead."""
    fsdp: int = 1
    """FSDP2 shard degree inside each replica group (>= 1): this many ranks shard the
    section's parameters, gradients and optimizer state (``fully_shard`` per transformer
    block, then the root). FSDP ranks are data parallel: each runs its own micro-batches, so
    the scheduler sees ``dp * fsdp`` replicas. With ``dp > 1`` too it is HSDP (replicated
    over ``dp``, sharded over ``fsdp``)."""
    tp: int = 1
    """Tensor-parallel degree (>= 1): this many ranks split every transformer block
    (attention heads and MLP columns, DTensor ``parallelize_module``) and share one
    micro-batch stream; heads and MLP width must divide by it. A section takes
    ``dp * fsdp * pp * cp * tp`` ranks (rank order dp x fsdp x pp x cp x tp, TP innermost)."""
    pp: int = 1
    """Pipeline stages per replica (>= 1): the section's blocks (``maestro.Parallelism``)
    are cut into ``pp`` contiguous stages on as many ranks (each stage a TP group of ``tp``
    ranks, sharded by FSDP over ``fsdp``), and its micro-batches flow through them: 1F1B for a
    sink, all forwards then all backwards for a section whose gradients come from consumers,
    forward only when frozen. The first stage receives gradients' targets from producers and
    the last sends outputs to consumers; parameters outside the blocks (embeddings, head) are
    kept on every stage and their gradients summed over the stages. The section's forward
    must run its blocks once per micro-batch, in order, each taking and returning the hidden
    state. Not with ``group`` or ``zero``."""
    cp: int = 1
    """Context-parallel degree (>= 1): this many ranks share every sample of a replica, each
    holding a load-balanced share of its token sequence (``2 * cp`` chunks, rank ``r`` the
    ``r``-th and the ``r``-th from the end), and the section's
    ``scaled_dot_product_attention`` calls run as ring attention over them
    (``maestro.parallel.cp``); gradients are summed over the group. Every sample needs at
    least ``2 * cp`` tokens. Not with ``group``; with ``zero``, ``dp > 1`` and ``tp = 1``
    the optimizer state is sharded over the ``dp * cp`` ranks."""
    reshard_after_forward: bool = True
    """FSDP only: free each block's gathered parameters after its forward (gather again for
    the backward). ``false`` keeps them until the backward: less communication, more memory."""
    zero: int = 0
    """``1``: ZeRO-1, the optimizer state is sharded across the section's ``dp`` replicas
    (each steps a 1/dp slice of the flattened parameters, then the slices are all-gathered).
    ``0``: every replica holds the whole state. Needs ``fsdp = 1`` (FSDP already shards it)."""
    recompute: bool = False
    """Activation checkpointing per transformer block (``torch.utils.checkpoint``): keep only
    block inputs and recompute the block's forward in the backward. Trainable sections only."""
    group: str | None = None
    """Colocated group: sections naming the same group share its ranks instead of owning
    disjoint ones. Each member states its own grid over those ranks (``dp * fsdp * tp`` equal
    for all members; every member's ``tp`` divides the largest, ``T``; ``fsdp`` and ``zero``
    per member). A group replica is ``T`` ranks and runs every member on the same
    samples, one member after another, each on its own micro-batches (``micro_batch_size``,
    ``token_budget``); a member at ``tp < T`` splits the replica's samples over ``T / tp``
    sub-replicas and the replica then all-gathers its outputs (e.g. on 8 ranks a vision
    encoder at ``dp = 8`` beside an LLM at ``tp = 2, dp = 4``). Outputs stay in memory; each
    member keeps its own optimizer, ``lr`` and ``frozen``, and sums its gradients over its
    own ``dp``. ``None``: the section is disaggregated (its own ranks). Any name works;
    ``maestro plan`` writes the members joined by ``+``."""

    @property
    def data_parallel(self) -> int:
        """Data-parallel coordinates (``dp * fsdp``): the replicas a scheduler fills."""
        return self.dp * self.fsdp

    @property
    def num_ranks(self) -> int:
        """Ranks this section takes: ``dp * fsdp * pp * cp * tp``."""
        return self.dp * self.fsdp * self.pp * self.cp * self.tp

    def validate(self, where: str) -> None:
        """Raise ``ValueError`` naming the first bad field (``where`` is the table path)."""
        if self.frozen is None:
            self.frozen = False
        if not isinstance(self.frozen, bool):
            raise ValueError(f"{where}.frozen must be true or false, got {self.frozen!r}")
        if self.dp < 1:
            raise ValueError(f"{where}.dp must be >= 1, got {self.dp}")
        if self.micro_batch_size < 1:
            raise ValueError(f"{where}.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.frozen and self.optimizer not in (None, "none"):
            raise ValueError(
                f"{where}.optimizer: section is frozen = true but sets optimizer = "
                f"{self.optimizer!r}; a frozen section has no optimizer (remove the field)"
            )
        if not self.frozen:
            if self.optimizer is None:
                self.optimizer = "adamw"
            if not isinstance(self.optimizer, str):
                raise ValueError(f"{where}.optimizer must be a string")
            _check_optimizer_name(self.optimizer, f"{where}.optimizer")
        else:
            self.optimizer = None
            for f, default in (("lr_schedule", "constant"), ("warmup_steps", 0)):
                if getattr(self, f) != default:
                    raise ValueError(f"{where}.{f}: a frozen section has no optimizer")
            if self.grad_clip is not None or self.optimizer_args:
                f = "grad_clip" if self.grad_clip is not None else "optimizer_args"
                raise ValueError(f"{where}.{f}: a frozen section has no optimizer")
        if not isinstance(self.optimizer_args, dict):
            raise ValueError(f"{where}.optimizer_args must be a table")
        for k in ("lr", "weight_decay", "params"):
            if k in self.optimizer_args:
                raise ValueError(
                    f"{where}.optimizer_args.{k}: set {k} as its own field"
                    if k != "params"
                    else f"{where}.optimizer_args.params: the runtime passes the parameters"
                )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"{where}.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, "
                f"got {self.lr_schedule!r}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"{where}.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{where}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None:
            if isinstance(self.grad_clip, bool) or not isinstance(self.grad_clip, (int, float)):
                raise ValueError(f"{where}.grad_clip must be a number")
            if not self.grad_clip > 0:
                raise ValueError(f"{where}.grad_clip must be > 0, got {self.grad_clip}")
            self.grad_clip = float(self.grad_clip)
        if not self.lr > 0:
            raise ValueError(f"{where}.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"{where}.weight_decay must be >= 0, got {self.weight_decay}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"{where}.token_budget must be >= 1, got {self.token_budget}")
        if self.max_in_flight is not None:
            if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int):
                raise ValueError(f"{where}.max_in_flight must be an integer")
            if self.max_in_flight < 0:
                raise ValueError(f"{where}.max_in_flight must be >= 0, got {self.max_in_flight}")
            if not self.frozen:
                raise ValueError(
                    f"{where}.max_in_flight bounds a frozen section's run-ahead; this section "
                    "is trainable (set frozen = true or remove the field)"
                )
        for f in ("fsdp", "tp", "pp", "cp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}.{f} must be an integer >= 1, got {v!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"{where}.reshard_after_forward must be true or false")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"{where}.recompute must be true or false")
        if isinstance(self.zero, bool) or self.zero not in (0, 1):
            raise ValueError(f"{where}.zero must be 0 or 1, got {self.zero!r}")
        if self.zero and self.fsdp > 1:
            raise ValueError(
                f"{where}.zero = 1 needs fsdp = 1: FSDP already shards the optimizer state "
                f"(got fsdp = {self.fsdp})"
            )
        if self.zero and self.frozen:
            raise ValueError(f"{where}.zero: a frozen section has no optimizer state")
        if self.pp > 1 and self.zero:
            raise ValueError(
                f"{where}.pp: pipeline stages with zero = 1 are not supported; use fsdp to "
                "shard each stage's optimizer state"
            )
        if self.pp > 1 and self.group is not None:
            raise ValueError(
                f"{where}.pp: a pipelined section cannot join colocated group "
                f"{self.group!r}; give it its own ranks (remove group)"
            )
        if self.recompute and self.frozen:
            raise ValueError(f"{where}.recompute: a frozen section keeps no activations")
        if self.cp > 1:
            for f, bad in (("group", self.group is not None),):
                if bad:
                    raise ValueError(
                        f"{where}.cp: context parallelism does not compose with {f} yet "
                        f"(cp = {self.cp}); remove {f} or set cp = 1"
                    )
        if self.group is not None and (not isinstance(self.group, str) or not self.group):
            raise ValueError(f"{where}.group must be a non-empty string, got {self.group!r}")


def _check_optimizer_name(name: str, where: str) -> None:
    """``ValueError`` unless ``name`` is a short name, a ``torch.optim`` class or ``mod:Class``.

    ``torch.optim`` and user modules are imported only when the name needs them, so configs of
    the built-in optimizers load without torch.
    """
    if name in OPTIMIZERS:
        return
    import importlib

    if ":" in name:
        mod, _, cls = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{where}: cannot import {name!r} ({e})") from None
    else:
        import torch.optim

        obj = getattr(torch.optim, name, None)
        if obj is None:
            raise ValueError(
                f"{where}: unknown optimizer {name!r}; use adamw, sgd, a torch.optim class "
                "name (Adam, RMSprop, ...) or package.module:Class"
            )
    if not isinstance(obj, type):
        raise ValueError(f"{where}: {name!r} is not a class")


@dataclass
class KDConfig:
    """Knowledge distillation: a frozen decoder-only teacher and a smaller student."""

    vocab_size: int = 512
    """Tokens in the vocabulary (synthetic language from a sparse bigram chain)."""
    seq_len_min: int = 16
    """Shortest sample, in tokens (>= 2)."""
    seq_len_max: int = 128
    """Longest sample, in tokens; lengths are long-tailed (log-normal) between min and max."""
    teacher_dim: int = 256
    """Teacher width."""
    teacher_layers: int = 4
    """Teacher transformer blocks."""
    student_dim: int = 128
    """Student width."""
    student_layers: int = 2
    """Student transformer blocks."""
    heads: int = 4
    """Attention heads (teacher and student)."""
    alpha: float = 0.5
    """Weight of the KL term: loss = CE + alpha * T^2 * KL(teacher || student), per token."""
    temperature: float = 2.0
    """Distillation temperature T (> 0)."""
    top_k: int = 0
    """Send only the teacher's top-k logits per token (0 = the full distribution); bounds the
    transfer size to k values and k indices per token."""

    def validate(self, where: str) -> None:
        if self.seq_len_min < 2 or self.seq_len_max < self.seq_len_min:
            raise ValueError(
                f"{where}.seq_len_min/seq_len_max: need 2 <= min <= max, "
                f"got {self.seq_len_min}, {self.seq_len_max}"
            )
        for f in ("vocab_size", "teacher_dim", "teacher_layers", "student_dim", "heads"):
            if getattr(self, f) < 1:
                raise ValueError(f"{where}.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("teacher_dim", "student_dim"):
            if getattr(self, f) % self.heads:
                raise ValueError(f"{where}.{f} must be a multiple of heads={self.heads}")
        if self.student_layers < 1:
            raise ValueError(f"{where}.student_layers must be >= 1, got {self.student_layers}")
        if not self.temperature > 0:
            raise ValueError(f"{where}.temperature must be > 0, got {self.temperature}")
        if not 0 <= self.top_k <= self.vocab_size:
            raise ValueError(f"{where}.top_k must be in [0, vocab_size], got {self.top_k}")

    def default_inputs(self) -> dict[str, list[str]]:
        """The workload's sections and their inputs."""
        return {"teacher": [], "student": ["teacher"]}


@dataclass
class MLLMConfig:
    """Multimodal LLM: vision (and optionally audio) encoders feeding a decoder LLM."""

    vocab_size: int = 512
    """LLM vocabulary size."""
    seq_len_min: int = 16
    """Shortest text, in tokens (>= 2)."""
    seq_len_max: int = 128
    """Longest text; lengths are long-tailed (log-normal) between min and max."""
    llm_dim: int = 128
    """LLM width (also the projectors' output width)."""
    llm_layers: int = 2
    """LLM transformer blocks."""
    heads: int = 4
    """Attention heads (every section)."""
    vision_dim: int = 128
    """Vision encoder (ViT) width."""
    vision_layers: int = 2
    """Vision encoder blocks."""
    image_patches: int = 16
    """Patches per image (image tokens given to the LLM)."""
    patch_dim: int = 48
    """Values per patch (e.g. 4x4 pixels x 3 channels)."""
    image_pool: int = 1
    """Patches merged into one LLM token (mean of consecutive patches, like a 2x2 merge = 4);
    must divide ``image_patches``."""
    audio_dim: int = 64
    """Audio encoder width (used when the mix has audio)."""
    audio_layers: int = 1
    """Audio encoder blocks."""
    audio_frames: int = 24
    """Frames per audio clip (audio tokens given to the LLM)."""
    frame_dim: int = 40
    """Values per audio frame (e.g. mel bins)."""
    mix: dict[str, float] = field(default_factory=lambda: {"text": 0.4, "image": 0.6})
    """Modality mix: share of samples per kind; kinds are ``text``, ``image``, ``audio``,
    ``image+audio``. Shares must sum to 1. A mix with audio adds the ``audio`` section."""

    KINDS = ("text", "image", "audio", "image+audio")

    def validate(self, where: str) -> None:
        if self.seq_len_min < 2 or self.seq_len_max < self.seq_len_min:
            raise ValueError(
                f"{where}.seq_len_min/seq_len_max: need 2 <= min <= max, "
                f"got {self.seq_len_min}, {self.seq_len_max}"
            )
        for f in (
            "vocab_size",
            "llm_dim",
            "llm_layers",
            "heads",
            "vision_dim",
            "vision_layers",
            "image_patches",
            "patch_dim",
            "audio_dim",
            "audio_layers",
            "audio_frames",
            "frame_dim",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"{where}.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("llm_dim", "vision_dim", "audio_dim"):
            if getattr(self, f) % self.heads:
                raise ValueError(f"{where}.{f} must be a multiple of heads={self.heads}")
        if self.image_pool < 1 or self.image_patches % self.image_pool:
            raise ValueError(
                f"{where}.image_pool must be >= 1 and divide image_patches="
                f"{self.image_patches}, got {self.image_pool}"
            )
        for k, v in self.mix.items():
            if not isinstance(v, (int, float)):
                raise ValueError(f"{where}.mix.{k} must be a number, got {v!r}")
            if k not in self.KINDS:
                raise ValueError(f"{where}.mix: unknown kind {k!r}; kinds: {', '.join(self.KINDS)}")
            if v < 0:
                raise ValueError(f"{where}.mix.{k} must be >= 0, got {v}")
        if abs(sum(self.mix.values()) - 1.0) > 1e-6:
            raise ValueError(f"{where}.mix: shares must sum to 1, got {sum(self.mix.values())}")

    @property
    def has_audio(self) -> bool:
        """Whether any sample carries audio (then the graph has an ``audio`` section)."""
        return any(v > 0 for k, v in self.mix.items() if "audio" in k)

    def default_inputs(self) -> dict[str, list[str]]:
        """The workload's sections and their inputs."""
        d: dict[str, list[str]] = {"vision": []}
        if self.has_audio:
            d["audio"] = []
        d["llm"] = list(d)
        return d


@dataclass
class EvalConfig:
    """The ``[eval]`` table: evaluate on held-out records during training.

    Every ``every`` steps (and after the last step) the eval records run through the same
    layout and scheduler as training, forward only (``torch.no_grad``; frozen sections under
    ``inference_mode``; modules in ``eval()`` mode), with no optimizer step: training is
    unchanged. The eval loss is normalised like the training loss: the sinks' per-sample
    losses summed over every eval batch, divided by the sum of the batches' normalisers (the
    job's ``normaliser``); other per-sample scalars a sink returns (e.g. ``ce``, ``kl``) are
    averaged the same way.
    """

    data: str | None = None
    """A JSONL file of eval records (relative to the config's directory), read like the
    job's own dataset (a ``maestro.data.JsonlDataset`` job reads it with the same options and
    collate). ``None``: the job's own eval dataset (``job.eval_dataset``, see
    ``maestro.runtime.evaluation``)."""
    every: int | None = None
    """Evaluate after every this many optimizer steps (>= 1; required)."""
    batches: int | None = None
    """Evaluate on at most this many eval global batches (>= 1). ``None``: the whole file, in
    file order, in global batches of ``global_batch`` records (the last one partial)."""

    def validate(self, config_dir: str | None) -> None:
        """``ValueError`` naming the first bad ``eval.*`` field."""
        if self.every is None:
            raise ValueError("eval.every: missing; evaluate every how many steps (>= 1)")
        if isinstance(self.every, bool) or not isinstance(self.every, int):
            raise ValueError(f"eval.every must be an integer, got {self.every!r}")
        if self.every < 1:
            raise ValueError(f"eval.every must be >= 1, got {self.every}")
        if self.batches is not None:
            if isinstance(self.batches, bool) or not isinstance(self.batches, int):
                raise ValueError(f"eval.batches must be an integer, got {self.batches!r}")
            if self.batches < 1:
                raise ValueError(f"eval.batches must be >= 1, got {self.batches}")
        if self.data is not None:
            if not isinstance(self.data, str) or not self.data:
                raise ValueError(f"eval.data must be a path string, got {self.data!r}")
            path = self.data_path(config_dir)
            if not path.is_file():
                raise ValueError(f"eval.data: file {path} does not exist")

    def data_path(self, config_dir: str | None) -> Path:
        """``data`` resolved against the config's directory."""
        path = Path(self.data)
        if not path.is_absolute() and config_dir is not None:
            path = Path(config_dir) / path
        return path


#: the built-in jobs' short names: ``name -> (job function, its Config dataclass)``
BUILTIN_JOBS: dict[str, tuple[str, type]] = {
    "kd": ("maestro.workloads.kd:job", KDConfig),
    "mllm": ("maestro.workloads.mllm:job", MLLMConfig),
}


@dataclass
class TrainConfig:
    """A training run: workload, sections and the batch schedule."""

    workload: str
    """The job function, ``"package.module:function"`` (see ``maestro.job``), or a built-in
    job's short name: ``kd`` (distillation) or ``mllm`` (multimodal LLM)."""
    model: Any
    """The job's settings from the ``[workload]`` table (without ``name``): an instance of the
    job function's ``Config`` dataclass when it declares one (``KDConfig``, ``MLLMConfig``),
    else a plain dict of the free-form keys."""
    sections: dict[str, SectionConfig]
    """One entry per section of the workload, from ``[sections.NAME]`` tables."""
    global_batch: int = 16
    """Samples per optimizer step, over all replicas (>= 1)."""
    steps: int = 10
    """Optimizer steps to run (>= 1)."""
    seed: int = 0
    """Seeds the synthetic data and each section's initial weights (independent of layout)."""
    dtype: str = "float32"
    """Parameter and activation dtype: ``float32``, ``float64`` (exactness tests) or
    ``bfloat16`` (bf16 autocast compute; a trainable section keeps fp32 master weights)."""
    scheduler: str = "fifo"
    """Scheduler name (see ``maestro.schedule.SCHEDULERS``), or ``"package.module:function"``
    for a scheduler defined outside Maestro."""
    monolithic_micro_batch_size: int = 4
    """Micro-batch size of the ``--monolithic`` baseline (whole model per rank); the
    smallest ``token_budget`` of any section also caps its micro-batches' tokens."""
    monolithic_order: str = "data"
    """Sample order of the ``--monolithic`` baseline: ``data`` (contiguous shards in data
    order, as a ``DistributedSampler``), ``tokens`` (shards of equal token counts, each sorted
    by length: the planner's careful baseline, as trainers' group-by-length samplers) or
    ``balanced`` (shards of equal estimated work, by the scheduler's cost model; the
    planner's tuned baseline)."""
    threads: int = 1
    """Intra-op torch threads per rank on CPU."""
    max_memory: str | int | None = None
    """Per-rank budget for training state (parameters, gradients, optimizer state; not
    activations), e.g. ``"80GiB"``, ``"512MB"`` or a number of bytes. Every rank sums its
    sections' state (a colocated group's members together) before the first step and stops
    with a one-line error naming them when it does not fit. ``None``: no check."""
    cost_profile: str | None = None
    """JSON profile (``maestro profile``, e.g. ``--from-run``) whose fitted
    ``MeasuredCostModel`` the scheduler uses to estimate section costs. ``None``: a FLOP count
    of each section on the ``meta`` device (``maestro.runtime.costs``). ``fifo`` uses neither."""
    config_dir: str | None = None
    """Directory of the TOML file (``load`` sets it): a job module or ``file.py`` named by
    ``workload.name`` and relative paths the job reads resolve against it."""
    eval: EvalConfig | None = None
    """The ``[eval]`` table (``EvalConfig``): held-out evaluation every ``eval.every`` steps;
    ``None``: no evaluation."""
    log_dir: str | None = None
    """Rank 0 writes TensorBoard event files and ``metrics.jsonl`` here (relative to the
    config's directory; ``maestro train --log-dir`` overrides it). ``None``: no logs."""

    def validate(self) -> None:
        """Check every field; ``ValueError`` names the first bad one."""
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.monolithic_micro_batch_size < 1:
            raise ValueError(
                f"monolithic_micro_batch_size must be >= 1, got {self.monolithic_micro_batch_size}"
            )
        if self.monolithic_order not in ("data", "tokens", "balanced"):
            raise ValueError(
                "monolithic_order must be 'data', 'tokens' or 'balanced', got "
                f"{self.monolithic_order!r}"
            )
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.log_dir is not None and (not isinstance(self.log_dir, str) or not self.log_dir):
            raise ValueError(f"log_dir must be a path string, got {self.log_dir!r}")
        if self.max_memory is not None:
            parse_bytes(self.max_memory, "max_memory")
        if self.cost_profile is not None:
            if not isinstance(self.cost_profile, str) or not self.cost_profile:
                raise ValueError(f"cost_profile must be a path string, got {self.cost_profile!r}")
            if not Path(self.cost_profile).is_file():
                raise ValueError(
                    f"cost_profile: {self.cost_profile} is not a file (write one with `maestro "
                    "profile CONFIG --from-run --out PATH`)"
                )
        if self.scheduler == "monolithic":
            # the monolithic schedule colocates every section on every rank: a run mode, not a
            # section schedule the executor can run
            raise ValueError(
                "scheduler = 'monolithic' is the baseline's run mode: run `maestro train CONFIG "
                "--monolithic` (with monolithic_micro_batch_size or --mbs) instead"
            )
        if ":" not in self.scheduler:
            from maestro.schedule import get_scheduler

            get_scheduler(self.scheduler)  # ValueError lists the known names
        if hasattr(self.model, "validate"):
            self.model.validate("workload")
        structure = self.workload_structure()
        wanted = {n: ins for n, (ins, _) in structure.items()}
        for name in self.sections:
            if name not in wanted:
                raise ValueError(
                    f"sections.{name}: workload {self.workload!r} has no section {name!r}; "
                    f"its sections: {', '.join(wanted)}"
                )
        for name in wanted:
            if name not in self.sections:
                raise ValueError(f"sections.{name}: missing table [sections.{name}]")
        for name, sc in self.sections.items():
            if sc.frozen is None:
                sc.frozen = bool(structure[name][1])
            sc.validate(f"sections.{name}")
        for name, sc in self.sections.items():
            if self.global_batch < sc.data_parallel:
                raise ValueError(
                    f"global_batch = {self.global_batch} is smaller than sections.{name}'s "
                    f"{sc.data_parallel} data-parallel replicas (dp x fsdp): a replica would "
                    f"get no sample; set global_batch >= {sc.data_parallel} or lower dp"
                )
        topological_order(self.section_inputs(), where="sections")
        for name, ins in self.section_inputs().items():
            for p in ins:
                if not self.sections[p].frozen and self.sections[name].frozen:
                    raise ValueError(
                        f"sections.{name}.frozen: a frozen section cannot read trainable "
                        f"section {p!r} (no gradient would reach it)"
                    )
        self._validate_groups()
        if self.eval is not None:
            self.eval.validate(self.config_dir)
            from maestro.job import eval_dataset

            eval_dataset(self.job(), self)  # ValueError when the job has no eval data

    def _validate_groups(self) -> None:
        """Colocated groups: one shared grid per group, and a merged graph without a cycle."""
        edges = self.section_inputs()
        order = topological_order(edges)
        groups: dict[str, list[str]] = {}
        for n in order:
            g = self.sections[n].group
            if g is not None:
                groups.setdefault(g, []).append(n)
        for g, members in groups.items():
            if len(members) < 2:
                continue
            first = self.sections[members[0]]
            top = max(self.sections[n].tp for n in members)
            for n in members:
                sc = self.sections[n]
                if sc.num_ranks != first.num_ranks:
                    raise ValueError(
                        f"sections.{n}: members of group {g!r} share its ranks; "
                        f"{members[0]} takes dp*fsdp*tp = {first.num_ranks} ranks, {n} takes "
                        f"{sc.num_ranks}"
                    )
                if top % sc.tp:
                    raise ValueError(
                        f"sections.{n}.tp: inside group {g!r} every member's tp must divide "
                        f"the largest ({top}); {n} has tp = {sc.tp}"
                    )
                for f, ok, why in (
                    (
                        "max_in_flight",
                        sc.max_in_flight is None,
                        "a colocated member cannot run ahead of its group",
                    ),
                ):
                    if not ok:
                        raise ValueError(f"sections.{n}.{f}: {why}")
        unit = {n: self._unit_of(n) for n in order}
        unit_edges: dict[str, list[str]] = {}
        for n in order:
            ins = unit_edges.setdefault(unit[n], [])
            for p in edges[n]:
                if unit[p] != unit[n] and unit[p] not in ins:
                    ins.append(unit[p])
        try:
            topological_order(unit_edges, where="groups")
        except ValueError:
            raise ValueError(
                "sections.*.group: a section outside a group lies on a path between two of "
                "its members (the group would run before and after it); regroup the sections"
            ) from None
        consumers = {n: [c for c in order if n in edges[c]] for n in order}
        for g, members in groups.items():
            if len(members) < 2:
                continue
            sinks = [n for n in members if not consumers[n]]
            leaves = [n for n in members for c in consumers[n] if c not in members]
            if sinks and leaves:
                raise ValueError(
                    f"sections.{leaves[0]}.group: group {g!r} holds the sink {sinks[0]!r} and "
                    f"also feeds sections outside it; the runtime runs a group as either a "
                    f"loss section or a producer"
                )

    def _unit_of(self, name: str) -> str:
        """The schedulable unit of section ``name``: itself, or its group's members joined
        by ``+`` (in topological order), as ``maestro.plan.colocate.group_name`` names it."""
        g = self.sections[name].group
        if g is None:
            return name
        members = [
            n for n in topological_order(self.section_inputs()) if self.sections[n].group == g
        ]
        return name if len(members) == 1 else "+".join(members)

    def units(self) -> dict[str, list[str]]:
        """``unit -> member sections``, producers first: a unit is a disaggregated section
        (``[name]``) or a colocated group (``"a+b" -> ["a", "b"]``, members in topological
        order)."""
        edges = self.section_inputs()
        members: dict[str, list[str]] = {}
        unit_edges: dict[str, list[str]] = {}
        for n in topological_order(edges):
            u = self._unit_of(n)
            members.setdefault(u, []).append(n)
            ins = unit_edges.setdefault(u, [])
            for p in edges[n]:
                pu = self._unit_of(p)
                if pu != u and pu not in ins:
                    ins.append(pu)
        return {u: members[u] for u in topological_order(unit_edges, where="groups")}

    def group_tp(self, unit: str) -> int:
        """A unit's TP degree: its section's, or the largest of a colocated group's members
        (a group replica is that many ranks; a member at a smaller ``tp`` splits the
        replica's samples over ``group_tp / tp`` sub-replicas of its own)."""
        return max(self.sections[m].tp for m in self.units()[unit])

    @property
    def colocated(self) -> bool:
        """Whether any group holds more than one section."""
        return any(len(m) > 1 for m in self.units().values())

    def workload_structure(self) -> dict[str, tuple[list[str], bool | None]]:
        """``section -> (inputs, frozen)`` as the job declares them.

        A job whose ``Config`` has ``default_inputs()`` declares its sections without being
        built (the built-ins: planning them imports no torch); any other job function is
        called once (``job()``) and its sections are read.
        """
        cached = getattr(self, "_structure", None)
        if cached is not None:
            return cached
        if hasattr(self.model, "default_inputs"):
            out = {n: (list(ins), None) for n, ins in self.model.default_inputs().items()}
        else:
            out = self.job().structure
        self._structure = out
        return out

    def job(self):
        """The ``maestro.Job`` this config names (built once per process, then cached)."""
        job = getattr(self, "_job", None)
        if job is None:
            from maestro.job import call_job_function, resolve_job_function

            fn = resolve_job_function(self.job_function, self.config_dir)
            job = call_job_function(fn, self)
            self._job = job
        return job.bind(self)

    @property
    def job_function(self) -> str:
        """``"package.module:function"`` of the job (a built-in's short name resolved)."""
        return BUILTIN_JOBS[self.workload][0] if self.workload in BUILTIN_JOBS else self.workload

    def section_inputs(self) -> dict[str, list[str]]:
        """``name -> input names``: the config's ``inputs`` where set, else the workload's."""
        wanted = {n: ins for n, (ins, _) in self.workload_structure().items()}
        return {
            n: (sc.inputs if sc.inputs is not None else wanted[n])
            for n, sc in self.sections.items()
        }

    @property
    def world_size(self) -> int:
        """Ranks a Maestro run needs: the sum over sections of ``num_ranks`` (a colocated
        group counted once)."""
        return sum(self.sections[m[0]].num_ranks for m in self.units().values())

    def check_world_size(self, world_size: int) -> None:
        """``ValueError`` (one line, naming every section's degrees) unless the sections'
        ranks add up to ``world_size``."""
        if self.world_size != world_size:
            plain = all(sc.num_ranks == sc.dp for sc in self.sections.values())
            if plain:
                parts = ", ".join(f"{n}={sc.dp}" for n, sc in self.sections.items())
                what = "the sum of dp"
            else:
                pp = any(sc.pp > 1 for sc in self.sections.values())
                cp = any(sc.cp > 1 for sc in self.sections.values())
                parts = ", ".join(
                    f"{n}=dp {sc.dp} x fsdp {sc.fsdp}"
                    + (f" x pp {sc.pp}" if pp else "")
                    + (f" x cp {sc.cp}" if cp else "")
                    + f" x tp {sc.tp}"
                    for n, sc in self.sections.items()
                )
                what = (
                    "the sum of dp x fsdp" + (" x pp" if pp else "") + (" x cp" if cp else "")
                ) + " x tp"
            if self.colocated:
                what += " (a colocated group counted once)"
            raise ValueError(
                f"sections.*.dp: {what} is {self.world_size} ({parts}) but the world "
                f"size is {world_size}; sections get disjoint ranks"
            )

    def section_specs(self) -> list[SectionSpec]:
        """The sections as the scheduler sees them, producers first."""
        edges = self.section_inputs()
        return [
            SectionSpec(
                name=n,
                inputs=tuple(edges[n]),
                dp=self.sections[n].data_parallel,
                tp=self.sections[n].tp,
                micro_batch_size=self.sections[n].micro_batch_size,
                frozen=self.sections[n].frozen,
                token_budget=self.sections[n].token_budget,
                max_in_flight=self.sections[n].max_in_flight,
            )
            for n in topological_order(edges)
        ]

    def unit_specs(self) -> list[SectionSpec]:
        """The schedulable units as the scheduler sees them, producers first: each
        disaggregated section as in ``section_specs``, each colocated group as one virtual
        section ``"a+b"`` (inputs: the units its members read from outside it; frozen when
        every member is; no token budget of its own). A group micro-batch holds the largest
        member ``micro_batch_size`` when the group is the whole model, else the smallest
        (the rule ``maestro.plan`` scores layouts with: ``plan.colocate.merged_specs``)."""
        specs = {s.name: s for s in self.section_specs()}
        units = self.units()
        if len(units) == len(specs):
            return list(specs.values())
        unit_of = {n: u for u, ms in units.items() for n in ms}
        pick = max if len(units) == 1 else min
        out = []
        for u, ms in units.items():
            if len(ms) == 1:
                s = specs[ms[0]]
                ins = tuple(dict.fromkeys(unit_of[p] for p in s.inputs))
                out.append(dataclasses.replace(s, inputs=ins))
                continue
            ins = tuple(
                dict.fromkeys(unit_of[p] for n in ms for p in specs[n].inputs if p not in ms)
            )
            out.append(
                SectionSpec(
                    name=u,
                    inputs=ins,
                    dp=self.sections[ms[0]].num_ranks // self.group_tp(u),
                    tp=self.group_tp(u),
                    micro_batch_size=pick(self.sections[n].micro_batch_size for n in ms),
                    frozen=all(self.sections[n].frozen for n in ms),
                    token_budget=None,
                )
            )
        return out

    def unit_layout(self) -> dict[str, list[int]]:
        """``unit -> global ranks``: contiguous blocks of ``num_ranks`` ranks in
        topological order (a colocated group's block shared by its members)."""
        layout, r = {}, 0
        for u, ms in self.units().items():
            n = self.sections[ms[0]].num_ranks
            layout[u] = list(range(r, r + n))
            r += n
        return layout

    def rank_layout(self) -> dict[str, list[int]]:
        """``section -> global ranks``: contiguous blocks of ``num_ranks`` ranks in
        topological order (``maestro.parallel.mesh`` arranges a block as dp x fsdp x pp x cp
        x tp);
        the members of a colocated group share its block."""
        by_unit = self.unit_layout()
        return {n: by_unit[u] for u, ms in self.units().items() for n in ms}

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that ``from_dict`` reads back (used to ship configs to workers)."""
        d = dataclasses.asdict(self)
        d["workload"] = {"name": self.workload, **d.pop("model")}
        return d


def job_config_class(name: str, base_dir: str | None = None) -> type | None:
    """The ``Config`` dataclass of job ``name`` (``None``: free-form ``[workload]`` keys).

    ``ValueError`` when ``name`` is neither a built-in nor an importable
    ``package.module:function``.
    """
    if name in BUILTIN_JOBS:
        return BUILTIN_JOBS[name][1]
    if ":" not in name:
        raise ValueError(
            f"workload.name: unknown workload {name!r}; give your job as "
            f'"package.module:function" or a built-in: {", ".join(BUILTIN_JOBS)}'
        )
    from maestro.job import resolve_job_function

    cls = getattr(resolve_job_function(name, base_dir), "Config", None)
    return cls if cls is not None and dataclasses.is_dataclass(cls) else None


def _build(cls: type, data: Any, where: str):
    """Instantiate dataclass ``cls`` from a TOML table, rejecting unknown keys and bad types."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ValueError(
                f"{where}.{key}: unknown field; known fields: {', '.join(sorted(fields))}"
            )
        default = getattr(cls(), key) if _has_defaults(cls) else None
        kwargs[key] = _coerce(value, default, f"{where}.{key}")
    return cls(**kwargs)


def _has_defaults(cls: type) -> bool:
    return all(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )


def _coerce(value: Any, default: Any, where: str) -> Any:
    """Check ``value`` against the type of the field's default (ints are accepted as floats)."""
    if default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
    elif isinstance(default, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table, got {value!r}")
    return value


def parse_bytes(value, where: str) -> int:
    """``80GiB``, ``512MB``, ``1e9`` or an int -> bytes; ``ValueError`` naming ``where``."""
    import re

    if isinstance(value, bool):
        raise ValueError(f"{where} must be a size such as '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{where} must be > 0, got {value!r}")
        return int(value)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    units.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in units or float(m.group(1)) <= 0:
        raise ValueError(f"{where} must be a size such as '80GiB' or '512MB', got {value!r}")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """``n`` bytes as ``1.5 GiB`` / ``12.0 MiB`` / ``300 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build and validate a ``TrainConfig`` from a parsed TOML document."""
    data = dict(data)
    wl = data.pop("workload", None)
    if isinstance(wl, str):  # `workload = "package.module:function"`, no settings
        wl = {"name": wl}
    if not isinstance(wl, dict) or "name" not in wl:
        raise ValueError(
            'workload.name: missing; add [workload] with name = "package.module:function" '
            '(your job) or a built-in: "kd", "mllm"'
        )
    wl = dict(wl)
    name = wl.pop("name")
    if not isinstance(name, str):
        raise ValueError(f"workload.name must be a string, got {name!r}")
    base_dir = data.get("config_dir")
    cls = job_config_class(name, base_dir)
    model = _build(cls, wl, "workload") if cls is not None else wl
    secs = data.pop("sections", None)
    if not isinstance(secs, dict) or not secs:
        raise ValueError("sections: missing; add one [sections.NAME] table per section")
    sections = {n: _build(SectionConfig, t, f"sections.{n}") for n, t in secs.items()}
    for n, sc in sections.items():
        if sc.inputs is not None and (
            not isinstance(sc.inputs, list) or not all(isinstance(x, str) for x in sc.inputs)
        ):
            raise ValueError(f"sections.{n}.inputs must be a list of section names")
        if sc.optimizer is not None and not isinstance(sc.optimizer, str):
            raise ValueError(f"sections.{n}.optimizer must be a string")
    ev = data.pop("eval", None)
    if ev is not None:
        ev = _build(EvalConfig, ev, "eval")
    top = {f.name for f in dataclasses.fields(TrainConfig)} - {"workload", "model", "sections"}
    for key in data:
        if key not in top:
            raise ValueError(f"{key}: unknown field; known fields: {', '.join(sorted(top))}")
    defaults = TrainConfig(workload=name, model=model, sections=sections)
    kwargs = {k: _coerce(v, getattr(defaults, k), k) for k, v in data.items()}
    cfg = TrainConfig(workload=name, model=model, sections=sections, eval=ev, **kwargs)
    cfg.validate()
    return cfg


def loads(text: str, config_dir: str | Path | None = None) -> TrainConfig:
    """Parse and validate a TOML string (``config_dir``: where job files and data resolve)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"invalid TOML: {e}") from None
    if config_dir is not None and "config_dir" not in data:
        data["config_dir"] = str(Path(config_dir).resolve())
    return from_dict(data)


def load(path: str | Path) -> TrainConfig:
    """Read, parse and validate a TOML config file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    return loads(path.read_text(), config_dir=path.parent)
