"""What the planner plans for: a global batch, a section graph and a cost model.

Three sources, by the CONFIG argument of ``maestro plan``:

- a paper-like scenario name (``kd``, ``mllm``, ``mllm-audio``; see ``maestro.sim.scenarios``)
  on an analytical GPU preset;
- a scenario file: TOML with a ``[scenario]`` table naming a built-in scenario
  (``examples/paper_*.toml``), or with ``[sections.NAME]`` tables describing the user's own
  sections, modalities and token counts (``maestro.sim.scenario_file``,
  ``examples/optimus_table10.toml``);
- a run config TOML (``examples/kd.toml``): its workload's real batch, timed on this machine
  (``maestro profile``) for a ``MeasuredCostModel``, with the sections' structure
  (``section_facts``) so that tp, fsdp and recompute are priced too; memory is not limited.

Which sections may be tensor-parallel at all is the runtime's own rule
(``maestro.parallel.apply.module_tp_refusal``), asked of the modules the plan is for, built
on the ``meta`` device: a run config's, or the Hugging Face job a scenario's ``--out`` writes
(``scenario_tp_plans``). The cost model carries the answer (``SectionShape.tp_plan``,
``SectionFacts.tp_plan``) and the planner gives ``tp > 1`` only where it is yes.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from maestro.costmodel import CostModel
from maestro.plan.modules import meta_graph, section_tp_plans
from maestro.schedule.types import SampleInfo, SectionSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: the built-in scenarios: the light ones, their aliases and the paper-like heavy ones
from maestro.sim.scenarios import NAMES as SCENARIOS

#: image+audio share of the mllm-audio scenario at 40% text-only (kept proportional).
_AUDIO_AT_40 = 0.15


@dataclass
class ScenarioSpec:
    """A paper-like scenario, as in the ``[scenario]`` table of ``examples/paper_*.toml``."""

    name: str = "kd"
    """A scenario of ``maestro.sim.scenarios.NAMES`` (``kd``, ``mllm``, ``mllm-audio``: light;
    ``kd-72b``, ``mllm-vl``, ``mllm-internvl``: paper-like)."""
    gpu: str = "H100"
    """Analytical GPU preset: ``H100`` or ``H200``."""
    gpus: int = 256
    """Default GPU budget (``--gpus`` overrides)."""
    samples_per_gpu: int = 8
    """Global batch per GPU of the budget; the batch is fixed when fewer GPUs are planned."""
    text_only: float = 0.4
    """Text-only share of MLLM samples (the rest carry an image; in ``mllm-audio``, images
    and image+audio keep the 45:15 split)."""
    seed: int = 0
    """Seed of the synthetic batch."""

    def validate(self) -> None:
        """``ValueError`` naming the first bad field."""
        if self.name not in SCENARIOS:
            raise ValueError(
                f"scenario.name: unknown scenario {self.name!r}; choose one of: "
                f"{', '.join(SCENARIOS)}"
            )
        if self.gpus < 1:
            raise ValueError(f"scenario.gpus must be >= 1, got {self.gpus}")
        if self.samples_per_gpu < 1:
            raise ValueError(f"scenario.samples_per_gpu must be >= 1, got {self.samples_per_gpu}")
        if not 0 <= self.text_only <= 1:
            raise ValueError(f"scenario.text_only must be in [0, 1], got {self.text_only}")


@dataclass
class Workload:
    """A planning problem's fixed part.

    Args:
        label: for reports.
        samples: the global batch.
        sections: the section graph (dp and micro-batch sizes are what the planner chooses).
        cost_model: analytical (scenarios) or measured (run configs).
        gpus: the default GPU budget.
        config: the run config, when planning one (the output keeps everything else).
        scenario: the scenario, when planning one.
        baseline_samples: the batch as the baselines (other systems) run it, when that
            differs from ``samples`` (``maestro.sim.scenarios.Scenario.baseline_samples``).
    """

    label: str
    samples: list[SampleInfo]
    sections: list[SectionSpec]
    cost_model: CostModel
    gpus: int
    config: object | None = None
    scenario: ScenarioSpec | None = None
    baseline_samples: list[SampleInfo] | None = None


def scenario_workload(spec: ScenarioSpec, gpus: int | None = None) -> Workload:
    """Build the scenario's batch (``samples_per_gpu * spec.gpus`` samples) and graph."""
    from maestro.sim.scenarios import build, mllm_samples

    spec.validate()
    from maestro.sim.scenarios import HEAVY_BATCH

    # the heavy scenarios keep one global batch for every budget (strong scaling)
    n = HEAVY_BATCH.get(spec.name) or spec.samples_per_gpu * spec.gpus
    sc = build(spec.name, max(spec.gpus, 3), n, spec.gpu, spec.seed, spec.text_only)
    samples = sc.samples
    if spec.name == "mllm-audio" and spec.text_only != 0.4:
        audio = _AUDIO_AT_40 * (1 - spec.text_only) / 0.6
        samples = mllm_samples(n, spec.text_only, audio, spec.seed)
    if "vision" in {s.name for s in sc.sections}:
        # the configured share (the heavy scenarios default to 30%: maestro.sim.scenarios)
        share = 0.3 if spec.name in HEAVY_BATCH and spec.text_only == 0.4 else spec.text_only
        label = f"{spec.name} ({spec.gpu}, {share:.0%} text-only)"
    else:
        label = f"{spec.name} ({spec.gpu})"
    cm = sc.cost_model
    plans = scenario_tp_plans(spec.name)
    if plans is not None:
        # the runtime's answer for the modules --out writes wins over the shapes' declaration
        shapes = {n: replace(sh, tp_plan=plans.get(n, sh.tp_plan)) for n, sh in cm.shapes.items()}
        cm = replace(cm, shapes=shapes)
    return Workload(
        label, samples, sc.sections, cm, gpus or spec.gpus, None, spec, sc.baseline_samples
    )


@functools.cache
def _scenario_tp_plans(name: str) -> tuple[tuple[str, bool], ...] | None:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # (a broken install: the shapes' declaration stands)
        return None

    from maestro.config import from_dict
    from maestro.hf.scenarios import scenario_job
    from maestro.sim.scenarios import build

    try:
        job, job_cfg = scenario_job(name)
    except ValueError:  # a scenario without a Hugging Face job: its shapes' declaration stands
        return None
    secs = {s.name: {} for s in build(name, 3, 1).sections}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # (the Whisper config warns of its token ids)
    try:
        cfg = from_dict({"workload": {"name": job, **vars(job_cfg)}, "sections": secs})
        return tuple(section_tp_plans(cfg).items())
    finally:
        hf_logging.set_verbosity(verbosity)


def scenario_tp_plans(name: str) -> dict[str, bool] | None:
    """``section -> whether the runtime can split it tensor-parallel`` for scenario ``name``:
    ``section_tp_plans`` of the Hugging Face job its ``--out`` writes (``maestro.hf.
    scenarios``, full-scale shapes on the ``meta`` device; cached per name). ``None`` without
    ``transformers``: the scenario's shapes then keep their declared ``tp_plan``."""
    got = _scenario_tp_plans(name)
    return None if got is None else dict(got)


def scenario_file_workload(path: Path, gpus: int | None = None) -> Workload:
    """A scenario file with its own sections (``maestro.sim.scenario_file``): the user's
    models, modalities and token counts on an analytical GPU preset."""
    from maestro.sim import scenario_file

    sf = scenario_file.load(path)
    sc = scenario_file.build(sf, gpus)
    label = f"{sf.label} ({sf.gpu.name}, scenario file)"
    return Workload(label, sc.samples, sc.sections, sc.cost_model, gpus or sf.gpus)


def load_scenario(path: Path) -> ScenarioSpec:
    """Read a scenario file's ``[scenario]`` table (unknown keys are errors)."""
    data = tomllib.loads(path.read_text())
    table = data.get("scenario")
    if not isinstance(table, dict):
        raise ValueError(f"{path}: no [scenario] table")
    known = {f.name for f in fields(ScenarioSpec)}
    for k in table:
        if k in ("hardware", "global_batch"):
            raise ValueError(
                f"{path}: [scenario] {k}: a scenario file of its own sections needs "
                "[sections.NAME] tables (maestro.sim.scenario_file); a built-in scenario's "
                "file gives name instead"
            )
        if k not in known:
            raise ValueError(
                f"scenario.{k}: unknown field; known fields: {', '.join(sorted(known))}"
            )
    spec = ScenarioSpec(**table)
    spec.validate()
    return spec


def section_facts(config) -> dict:
    """``section -> SectionFacts`` of a run config's sections, counted on their modules built
    on the ``meta`` device: the transformer blocks ``maestro.parallel`` shards and splits
    (``transformer_blocks``), their width, whether and by which degrees TP may split them
    (``module_tp_refusal``), and the bytes of parameters, gradients and (AdamW) optimizer
    state. A section without blocks has no facts (plain replicas only)."""
    import torch

    from maestro.costmodel import SectionFacts
    from maestro.parallel.apply import module_tp_refusal, transformer_blocks

    out = {}
    for sec in meta_graph(config):
        params = list(sec.module.parameters())
        total = float(sum(q.numel() * q.element_size() for q in params))
        try:
            blocks = transformer_blocks(sec.module, sec.parallel, f"sections.{sec.name}")
        except ValueError:
            blocks = []  # the runtime says why, in one line, when the layout needs them
        if not blocks or total <= 0:
            continue
        in_blocks = float(sum(q.numel() * q.element_size() for b in blocks for q in b.parameters()))
        lin = next((m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear)), None)
        hidden = lin.in_features if lin is not None else 0
        heads = _tp_divisor(blocks[0], sec.parallel)
        trainable = not config.sections[sec.name].frozen
        grads = float(sum(q.numel() * q.element_size() for q in params if q.requires_grad))
        grads = grads if trainable else 0.0
        out[sec.name] = SectionFacts(
            blocks=len(blocks),
            hidden=hidden,
            param_bytes=total,
            grad_bytes=grads,
            block_fraction=in_blocks / total,
            heads=heads,
            act_bytes=float(params[0].element_size()),
            # weights, gradients and AdamW's two moments
            state_bytes=total + 3.0 * grads if trainable else total,
            tp_plan=module_tp_refusal(sec.module, spec=sec.parallel) is None,
        )
    return out


def _tp_divisor(block, spec=None) -> int:
    """The largest number every TP degree of ``block`` must divide (heads, key/value heads,
    MLP width), as ``maestro.parallel.tp`` checks (the section's ``Parallelism`` when it
    gives a TP plan); 0 when unknown."""
    import math

    if spec is not None and (spec.tp_plan is not None or spec.parallelize is not None):
        from maestro.parallel.spec import plan_divisor

        return plan_divisor(block, spec)

    heads = getattr(block, "heads", None)
    if heads is not None and hasattr(block, "fc1"):
        return math.gcd(int(heads), int(block.fc1.out_features))
    attn = getattr(block, "self_attn", None)
    cfg = getattr(attn, "config", None)
    if cfg is None:
        return 0
    h = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", h) or h)
    down = getattr(getattr(block, "mlp", None), "down_proj", None)
    width = int(down.in_features) if down is not None else h
    return math.gcd(math.gcd(h, kv), width)


def run_config_workload(path: Path, gpus: int | None, hardware: str):
    """``maestro plan RUN.toml --hardware HW``: the run config's batch and sections, priced
    on the analytical ``hardware``."""
    from maestro.config import load
    from maestro.plan.run_shapes import analytical_model
    from maestro.workloads import get_workload

    cfg = load(path)
    wl = get_workload(cfg)
    samples = wl.sample_infos(wl.batch(0), wl.graph(build=[]))
    cm = analytical_model(cfg, samples, hardware)
    label = f"{path.stem} ({cm.gpu.name}, analytical)"
    return Workload(label, samples, cfg.section_specs(), cm, gpus or cfg.world_size, cfg)


def load_workload(
    config: str, gpus: int | None = None, profile=None, hardware: str | None = None
) -> Workload:
    """The workload named by ``maestro plan``'s CONFIG argument.

    Args:
        config: a scenario name, a scenario TOML or a run config TOML.
        gpus: the budget (default: the scenario's, or the run config's sum of dp).
        profile: JSON profile from ``maestro profile`` for a run config (a path, a dict, or a
            ``MeasuredCostModel``; measured now if omitted).
        hardware: price a run config's own sections (their modules' shapes, its data's
            lengths) on this analytical GPU instead of timing them here
            (``maestro.plan.run_shapes``).
    """
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if hardware is not None and profile is not None:
        raise ValueError("--hardware prices on an analytical GPU; --profile times this machine")
    if hardware is not None and config in SCENARIOS:
        raise ValueError("--hardware is for run configs; a scenario names its own GPU preset")
    if config in SCENARIOS:
        return scenario_workload(ScenarioSpec(name=config, gpus=gpus or 256), gpus)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(
            f"config file not found: {path} (or give a scenario: {', '.join(SCENARIOS)})"
        )
    try:
        head = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    from maestro.sim.scenario_file import is_scenario_file

    if hardware is not None and "scenario" in head:
        raise ValueError("--hardware is for run configs; a scenario file names its own GPU")
    if is_scenario_file(head):
        return scenario_file_workload(path, gpus)
    if "scenario" in head:
        spec = load_scenario(path)
        if gpus is not None:
            spec.gpus = gpus
        return scenario_workload(spec, gpus)

    if hardware is not None:
        return run_config_workload(path, gpus, hardware)
    from maestro.config import load
    from maestro.costmodel import MeasuredCostModel
    from maestro.workloads import get_workload

    cfg = load(path)
    if profile is None:
        from maestro.profiling.sections import profile_config

        print("profiling the sections on this machine (pass --profile to reuse one) ...")
        cm = MeasuredCostModel.from_profile(profile_config(cfg))
    elif isinstance(profile, MeasuredCostModel):
        cm = profile
    else:
        cm = MeasuredCostModel.from_profile(profile)
    # the sections' structure prices tp, fsdp and recompute on the measured times
    cm.facts = {**section_facts(cfg), **cm.facts}
    wl = get_workload(cfg)
    graph = wl.graph(build=[])  # routing only: no weights
    samples = wl.sample_infos(wl.batch(0), graph)
    return Workload(path.stem, samples, cfg.section_specs(), cm, gpus or cfg.world_size, cfg)
