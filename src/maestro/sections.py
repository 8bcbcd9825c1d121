"""Sections and the section graph: the compound model as a DAG of independently placed parts.

A ``Section`` wraps any ``nn.Module`` with what the runtime needs to place it on its own ranks:
which sections it reads from (``inputs``), whether it is trained (``frozen``) and which samples
it runs on (``activates_on``). Sections exchange *per-sample* outputs: a dict of named tensors
for each sample (e.g. ``{"logits": (T, V)}``), so producers and consumers may batch samples
differently. A section without consumers is a *sink*: its per-sample outputs carry a scalar
``"loss"`` (summed over the sample's targets, not normalised; the runtime divides by the global
batch's normaliser).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


class SampleError(ValueError):
    """A mistake that one sample of one section shows (a per-token loss vector, a missing
    output, a token id outside the vocabulary): one line naming the section, the sample and
    what was expected. The runtime adds the step and the dataset record (``locate``)."""

    def __init__(self, section: str, sample_id: Any, what: str) -> None:
        self.section, self.sample_id, self.what, self.where = section, sample_id, what, ""
        super().__init__(str(self))

    def locate(self, where: str) -> None:
        """Add where the sample came from, e.g. ``" of step 3 (record 17, train.jsonl:18)"``."""
        self.where = where
        self.args = (str(self),)

    def __str__(self) -> str:
        return f"section {self.section!r}, sample {self.sample_id}{self.where}: {self.what}"


#: One sample of a global batch: its ``"id"`` and raw tensors (tokens, image patches, ...).
Sample = Mapping[str, Any]
#: What a section produces for one sample: named tensors.
Outputs = dict[str, torch.Tensor]
#: ``forward(module, samples, inputs) -> per-sample outputs``; ``inputs[producer][i]`` holds
#: the producer's outputs for ``samples[i]`` (``None`` when that producer skipped the sample).
SectionForward = Callable[
    [nn.Module, Sequence[Sample], Mapping[str, Sequence[Outputs | None]]], list[Outputs]
]


def default_forward(
    module: nn.Module, samples: Sequence[Sample], inputs: Mapping[str, Sequence[Outputs | None]]
) -> list[Outputs]:
    """Apply ``module`` to each sample alone, so any ``nn.Module`` works as a section.

    The module's input is the single tensor of the single producer's output for that sample, or
    ``sample["x"]`` for a section without inputs; a batch dimension of 1 is added and removed.
    """
    if len(inputs) > 1:
        raise ValueError("default_forward takes at most one input section; pass forward=")
    outs: list[Outputs] = []
    for i, sample in enumerate(samples):
        if inputs:
            (produced,) = inputs.values()
            got = produced[i]
            if got is None or len(got) != 1:
                raise ValueError("default_forward needs exactly one tensor from its producer")
            (x,) = got.values()
        else:
            x = sample["x"]
        outs.append({"out": module(x.unsqueeze(0)).squeeze(0)})
    return outs


class Section:
    """A part of a compound model with its own resources.

    Args:
        name: unique name (``"teacher"``, ``"vision"``, ...).
        module: any ``nn.Module``, or a zero-argument factory returning one (what a
            ``maestro.Job`` should pass: the runtime then builds it only on the ranks of this
            section, seeded by the run's seed and the section's name).
        inputs: names of the producer sections whose per-sample outputs this section reads.
        frozen: forward-only: runs under ``torch.inference_mode``, keeps no activations and
            sends no gradients back; its parameters are never updated.
        activates_on: ``activates_on(sample) -> bool``; ``None`` means every sample. A sample
            that does not activate a section never reaches it (and its consumers get ``None``).
        forward: ``forward(module, samples, inputs) -> list of per-sample output dicts``
            (see ``SectionForward``); defaults to ``default_forward``.
        loss: for a sink built on ``default_forward``: ``loss(outputs, sample) -> scalar``;
            its value becomes the sample's ``"loss"`` output.
        parallel: how the module is parallelised (``maestro.Parallelism``: its blocks, for
            FSDP, recompute and TP; its TP plan or ``parallelize`` function); ``None``: the
            defaults of ``maestro.parallel.spec.find_blocks``.
        cp_split: how context parallelism cuts a sample whose attention sequence the forward
            builds itself (``maestro.parallel.cp.SequenceSplit``, e.g. text with an image's
            tokens spliced in); ``None``: the sample's token tensors are cut (the default of
            ``maestro.parallel.cp``).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module | Callable[[], nn.Module],
        *,
        inputs: Sequence[str] = (),
        frozen: bool = False,
        activates_on: Callable[[Sample], bool] | None = None,
        forward: SectionForward | None = None,
        loss: Callable[[Outputs, Sample], torch.Tensor] | None = None,
        parallel: Any = None,
        cp_split: Any = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Section name must be a non-empty string, got {name!r}")
        if not isinstance(module, nn.Module) and not _zero_arg_callable(module):
            raise ValueError(
                f"section {name!r}: module must be an nn.Module or a zero-argument factory "
                f"returning one, got {type(module).__name__}"
            )
        if activates_on is not None and not callable(activates_on):
            raise ValueError(f"section {name!r}: activates_on must be callable")
        if forward is not None and not callable(forward):
            raise ValueError(f"section {name!r}: forward must be callable")
        if isinstance(inputs, str):
            raise ValueError(f"section {name!r}: inputs must be a list of names, not a string")
        from maestro.parallel.spec import Parallelism

        if parallel is not None and not isinstance(parallel, Parallelism):
            raise ValueError(
                f"section {name!r}: parallel must be a maestro.Parallelism, got "
                f"{type(parallel).__name__}"
            )
        self.name = name
        self.module = module
        self.inputs = tuple(inputs)
        self.frozen = bool(frozen)
        self.activates_on = activates_on
        self._forward = forward or default_forward
        self._loss = loss
        self.parallel = parallel
        self.cp_split = cp_split
        #: set by the job from the run's ``dtype``: bf16 autocast around the forward, and the
        #: dtype floating inputs are cast to (a bf16 frozen section's samples and inputs)
        self.autocast_dtype: torch.dtype | None = None
        self.input_dtype: torch.dtype | None = None

    def clone(self, module: nn.Module) -> Section:
        """The same section around another module (a built one, or a placeholder)."""
        out = Section(
            self.name,
            module,
            inputs=self.inputs,
            frozen=self.frozen,
            activates_on=self.activates_on,
            forward=self._forward,
            loss=self._loss,
            parallel=self.parallel,
            cp_split=self.cp_split,
        )
        out.autocast_dtype, out.input_dtype = self.autocast_dtype, self.input_dtype
        return out

    def activated(self, sample: Sample) -> bool:
        """Whether ``sample`` runs through this section."""
        return True if self.activates_on is None else bool(self.activates_on(sample))

    def run(
        self, samples: Sequence[Sample], inputs: Mapping[str, Sequence[Outputs | None]]
    ) -> list[Outputs]:
        """Forward one micro-batch: per-sample outputs, in the order of ``samples``."""
        if self.input_dtype is not None:
            samples = [_cast(s, self.input_dtype) for s in samples]
            inputs = {
                p: [None if o is None else _cast(o, self.input_dtype) for o in col]
                for p, col in inputs.items()
            }
        try:
            if self.autocast_dtype is not None:
                dev = next((p.device.type for p in self.module.parameters()), "cpu")
                with torch.autocast(device_type=dev, dtype=self.autocast_dtype):
                    outs = self._forward(self.module, samples, inputs)
            else:
                outs = self._forward(self.module, samples, inputs)
        except IndexError as e:
            bad = out_of_vocabulary(self.name, self.module, samples)
            if bad is not None:
                raise bad from e
            raise
        if not isinstance(outs, (list, tuple)) or len(outs) != len(samples):
            n = len(outs) if isinstance(outs, (list, tuple)) else 0
            got = f"{n} output(s)" if isinstance(outs, (list, tuple)) else type(outs).__name__
            first = samples[min(n, len(samples) - 1)]
            sid = first.get("id", n) if isinstance(first, Mapping) else n
            raise SampleError(
                self.name,
                sid,
                f"its forward returned {got} for a micro-batch of {len(samples)} samples; "
                "expected a list of one dict per sample, in the samples' order",
            )
        if self._loss is not None:
            for out, sample in zip(outs, samples):
                out["loss"] = self._loss(out, sample)
        return outs

    def __repr__(self) -> str:
        return f"Section({self.name!r}, inputs={list(self.inputs)}, frozen={self.frozen})"


def _zero_arg_callable(f: Any) -> bool:
    import inspect

    if not callable(f):
        return False
    try:
        inspect.signature(f).bind()
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): trust it
        return True
    return True


def _cast(d: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``d`` with its floating tensors cast to ``dtype`` (others unchanged)."""
    return {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in d.items()
    }


def topological_order(edges: Mapping[str, Sequence[str]], where: str = "sections") -> list[str]:
    """Names in dependency order (producers first); ``ValueError`` on unknown inputs or a cycle.

    Args:
        edges: ``name -> input names``; the order of ``edges`` breaks ties.
        where: prefix for error messages (the config path of the sections table).
    """
    for name, ins in edges.items():
        for p in ins:
            if p not in edges:
                known = ", ".join(edges)
                raise ValueError(
                    f"{where}.{name}.inputs: unknown section {p!r}; known sections: {known}"
                )
            if p == name:
                raise ValueError(f"{where}.{name}.inputs: a section cannot be its own input")
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cyc = path[path.index(n) :] + [n]
            raise ValueError(f"{where}.{n}.inputs: cycle {' -> '.join(cyc)}")
        state[n] = 1
        for p in edges[n]:
            visit(p, path + [n])
        state[n] = 2
        order.append(n)

    for n in edges:
        visit(n, [])
    return order


class SectionGraph:
    """A DAG of sections; edges carry named per-sample tensors from producer to consumer.

    Args:
        sections: the sections, in any order; names must be unique, inputs must name sections
            of the graph and there must be no cycle.

    Also checked: a trainable section must influence a loss (be a sink, or feed a trainable
    consumer through which gradients can flow), and a frozen section cannot feed gradients
    back, so a frozen consumer of a trainable producer is rejected.
    """

    def __init__(self, sections: Sequence[Section]) -> None:
        names = [s.name for s in sections]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate section names: {', '.join(sorted(dup))}")
        if not sections:
            raise ValueError("a SectionGraph needs at least one section")
        self._by_name = {s.name: s for s in sections}
        order = topological_order({s.name: s.inputs for s in sections})
        self.order: list[Section] = [self._by_name[n] for n in order]
        self._consumers: dict[str, list[str]] = {n: [] for n in names}
        for s in self.order:
            for p in s.inputs:
                self._consumers[p].append(s.name)
        for s in self.order:
            for c in self._consumers[s.name]:
                if self._by_name[c].frozen and not s.frozen:
                    raise ValueError(
                        f"section {c!r} is frozen but reads trainable section {s.name!r}: "
                        "no gradient could reach it"
                    )
        if not self.sinks():
            raise ValueError("the section graph has no sink (a section without consumers)")
        for s in self.order:
            if s.frozen and self.is_sink(s.name):
                raise ValueError(f"section {s.name!r} is frozen and has no consumer: it is unused")

    def __getitem__(self, name: str) -> Section:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    @property
    def names(self) -> list[str]:
        """Section names in topological order."""
        return [s.name for s in self.order]

    def consumers(self, name: str) -> list[str]:
        """Sections that read ``name``'s outputs, in topological order."""
        return list(self._consumers[name])

    def is_sink(self, name: str) -> bool:
        """True when no section reads ``name`` (its outputs carry the loss)."""
        return not self._consumers[name]

    def sinks(self) -> list[str]:
        """Names of the sections that produce the loss."""
        return [n for n in self.names if self.is_sink(n)]

    def modules(self) -> dict[str, nn.Module]:
        """``name -> module`` of every section."""
        return {s.name: s.module for s in self.order}


def out_of_vocabulary(
    section: str, module: nn.Module, samples: Sequence[Sample]
) -> SampleError | None:
    """The first sample whose token ids do not fit ``module``'s first embedding table
    (``None`` when every id fits, or the module has no embedding): what an ``IndexError:
    index out of range in self`` from ``nn.Embedding`` meant."""
    rows = next((m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if rows is None:
        return None
    for pos, s in enumerate(samples):
        if not isinstance(s, Mapping):
            continue
        for key in ("input_ids", "tokens"):  # maestro.job.TOKEN_KEYS
            ids = s.get(key)
            if not isinstance(ids, torch.Tensor) or ids.numel() == 0 or ids.is_floating_point():
                continue
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= rows:
                bad = hi if hi >= rows else lo
                return SampleError(
                    section,
                    s.get("id", pos),
                    f"token id {bad} in {key!r} is outside the section's embedding of {rows} "
                    f"rows (expected ids in [0, {rows}); was the data made with another "
                    "vocabulary or tokenizer?)",
                )
    return None
