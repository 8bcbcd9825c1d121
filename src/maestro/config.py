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

OPTIMIZERS = ("sgd", "adamw")
DTYPES = ("float32", "float64")


@dataclass
class SectionConfig:
    """Resources and training settings of one section."""

    dp: int = 1
    """Data-parallel replicas: this many disjoint ranks run the section (>= 1)."""
    micro_batch_size: int = 1
    """At most this many samples per micro-batch on each replica (>= 1)."""
    frozen: bool = False
    """Forward-only: no gradients, no optimizer, no activations kept (e.g. a KD teacher)."""
    optimizer: str | None = None
    """``"adamw"`` or ``"sgd"``; defaults to ``"adamw"`` for a trainable section. A frozen
    section must not set one."""
    lr: float = 1e-3
    """Learning rate of this section's optimizer (> 0)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD), >= 0."""
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

    def validate(self, where: str) -> None:
        """Raise ``ValueError`` naming the first bad field (``where`` is the table path)."""
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
            if self.optimizer not in OPTIMIZERS:
                raise ValueError(
                    f"{where}.optimizer must be one of {', '.join(OPTIMIZERS)}, "
                    f"got {self.optimizer!r}"
                )
        else:
            self.optimizer = None
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


WORKLOAD_CONFIGS: dict[str, type] = {"kd": KDConfig, "mllm": MLLMConfig}


@dataclass
class TrainConfig:
    """A training run: workload, sections and the batch schedule."""

    workload: str
    """Workload name: ``kd`` (distillation) or ``mllm`` (multimodal LLM)."""
    model: Any
    """The workload's settings (``KDConfig`` or ``MLLMConfig``), from the ``[workload]`` table."""
    sections: dict[str, SectionConfig]
    """One entry per section of the workload, from ``[sections.NAME]`` tables."""
    global_batch: int = 16
    """Samples per optimizer step, over all replicas (>= 1)."""
    steps: int = 10
    """Optimizer steps to run (>= 1)."""
    seed: int = 0
    """Seeds the synthetic data and each section's initial weights (independent of layout)."""
    dtype: str = "float32"
    """Parameter and activation dtype: ``float32`` or ``float64`` (exactness tests)."""
    scheduler: str = "fifo"
    """Scheduler name (see ``maestro.schedule.SCHEDULERS``), or ``"package.module:function"``
    for a scheduler defined outside Maestro."""
    monolithic_micro_batch_size: int = 4
    """Micro-batch size of the ``--monolithic`` baseline (whole model per rank)."""
    threads: int = 1
    """Intra-op torch threads per rank on CPU."""
    cost_profile: str | None = None
    """JSON profile (``maestro profile``, e.g. ``--from-run``) whose fitted
    ``MeasuredCostModel`` the scheduler uses to estimate section costs. ``None``: a FLOP count
    of each section on the ``meta`` device (``maestro.runtime.costs``). ``fifo`` uses neither."""

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
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
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
        self.model.validate("workload")
        wanted = self.model.default_inputs()
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
            sc.validate(f"sections.{name}")
        topological_order(self.section_inputs(), where="sections")
        for name, ins in self.section_inputs().items():
            for p in ins:
                if not self.sections[p].frozen and self.sections[name].frozen:
                    raise ValueError(
                        f"sections.{name}.frozen: a frozen section cannot read trainable "
                        f"section {p!r} (no gradient would reach it)"
                    )

    def section_inputs(self) -> dict[str, list[str]]:
        """``name -> input names``: the config's ``inputs`` where set, else the workload's."""
        wanted = self.model.default_inputs()
        return {
            n: (sc.inputs if sc.inputs is not None else wanted[n])
            for n, sc in self.sections.items()
        }

    @property
    def world_size(self) -> int:
        """Ranks a Maestro run needs: the sum of every section's ``dp``."""
        return sum(sc.dp for sc in self.sections.values())

    def check_world_size(self, world_size: int) -> None:
        """``ValueError`` unless ``sum(dp)`` equals ``world_size``."""
        if self.world_size != world_size:
            parts = ", ".join(f"{n}={sc.dp}" for n, sc in self.sections.items())
            raise ValueError(
                f"sections.*.dp: the sum of dp is {self.world_size} ({parts}) but the world "
                f"size is {world_size}; sections get disjoint ranks"
            )

    def section_specs(self) -> list[SectionSpec]:
        """The sections as the scheduler sees them, producers first."""
        edges = self.section_inputs()
        return [
            SectionSpec(
                name=n,
                inputs=tuple(edges[n]),
                dp=self.sections[n].dp,
                micro_batch_size=self.sections[n].micro_batch_size,
                frozen=self.sections[n].frozen,
                token_budget=self.sections[n].token_budget,
                max_in_flight=self.sections[n].max_in_flight,
            )
            for n in topological_order(edges)
        ]

    def rank_layout(self) -> dict[str, list[int]]:
        """``section -> global ranks``: contiguous blocks in topological order."""
        layout, r = {}, 0
        for spec in self.section_specs():
            layout[spec.name] = list(range(r, r + spec.dp))
            r += spec.dp
        return layout

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that ``from_dict`` reads back (used to ship configs to workers)."""
        d = dataclasses.asdict(self)
        d["workload"] = {"name": self.workload, **d.pop("model")}
        return d


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


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build and validate a ``TrainConfig`` from a parsed TOML document."""
    data = dict(data)
    wl = data.pop("workload", None)
    if not isinstance(wl, dict) or "name" not in wl:
        raise ValueError('workload.name: missing; add [workload] with name = "kd" or "mllm"')
    wl = dict(wl)
    name = wl.pop("name")
    if name not in WORKLOAD_CONFIGS:
        raise ValueError(
            f"workload.name: unknown workload {name!r}; choose one of: "
            f"{', '.join(WORKLOAD_CONFIGS)}"
        )
    model = _build(WORKLOAD_CONFIGS[name], wl, "workload")
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
    top = {f.name for f in dataclasses.fields(TrainConfig)} - {"workload", "model", "sections"}
    for key in data:
        if key not in top:
            raise ValueError(f"{key}: unknown field; known fields: {', '.join(sorted(top))}")
    defaults = TrainConfig(workload=name, model=model, sections=sections)
    kwargs = {k: _coerce(v, getattr(defaults, k), k) for k, v in data.items()}
    cfg = TrainConfig(workload=name, model=model, sections=sections, **kwargs)
    cfg.validate()
    return cfg


def loads(text: str) -> TrainConfig:
    """Parse and validate a TOML string."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"invalid TOML: {e}") from None
    return from_dict(data)


def load(path: str | Path) -> TrainConfig:
    """Read, parse and validate a TOML config file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    return loads(path.read_text())
