"""The workload interface: sections with seeded modules, global batches and scheduler inputs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from maestro.config import TrainConfig
from maestro.schedule.types import SampleInfo
from maestro.sections import Sample, Section, SectionGraph
from maestro.workloads.data import seed_for


class Workload:
    """A compound model plus its synthetic data.

    Subclasses implement ``_module(name)``, ``_section(name, module)``, ``batch(step)`` and
    ``_cost(sample)``. Modules are initialised from ``(config.seed, section name)`` only, so a
    section starts from the same weights whatever the layout and on whichever rank builds it.

    Args:
        config: the validated run config.
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.dtype = {"float32": torch.float32, "float64": torch.float64}[config.dtype]

    def build_module(self, name: str) -> nn.Module:
        """Section ``name``'s module with its seeded initial weights, in the run's dtype."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for("init", self.config.seed, name))
            module = self._module(name)
        module = module.to(self.dtype)
        if self.config.sections[name].frozen:
            module.requires_grad_(False).eval()
        return module

    def graph(self, build: Iterable[str] | None = None) -> SectionGraph:
        """The section graph; modules are built for the names in ``build`` (default: all).

        Sections not built get an empty ``nn.Module`` placeholder: a rank only needs its own
        section's weights, and the rest of the graph for routing.
        """
        names = list(self.config.section_inputs())
        build = set(names if build is None else build)
        sections = []
        for n in names:
            module = self.build_module(n) if n in build else nn.Module()
            sections.append(self._section(n, module))
        return SectionGraph(sections)

    def batch(self, step: int) -> list[Sample]:
        """Global batch of step ``step``: ``config.global_batch`` samples with ``"id"`` 0..B-1."""
        raise NotImplementedError

    def sample_infos(self, batch: Sequence[Sample], graph: SectionGraph) -> list[SampleInfo]:
        """What a scheduler needs about each sample of ``batch``.

        Returns one ``SampleInfo(sample_id, sections, cost)`` per sample: ``sections`` is the set
        of section names whose ``activates_on`` accepts it (so a text-only sample never lists
        ``vision``), and ``cost`` holds ``tokens`` (sequence length the LLM/student runs),
        ``text_tokens``, ``images`` and ``audio`` (counts per sample).
        """
        return [
            SampleInfo(
                sample_id=s["id"],
                sections=frozenset(sec.name for sec in graph if sec.activated(s)),
                cost=self._cost(s),
            )
            for s in batch
        ]

    def normaliser(self, batch: Sequence[Sample]) -> float:
        """Loss normaliser of a global batch: its number of predicted tokens."""
        return float(sum(s["tokens"].numel() - 1 for s in batch))

    def _module(self, name: str) -> nn.Module:
        raise NotImplementedError

    def _section(self, name: str, module: nn.Module) -> Section:
        raise NotImplementedError

    def _cost(self, sample: Sample) -> dict[str, float]:
        raise NotImplementedError
