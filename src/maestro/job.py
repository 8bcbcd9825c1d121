"""The public job API: a compound model and its data, written by the user in Python.

A run config names a *job function* (``[workload] name = "package.module:function"``); Maestro
calls it with the validated ``TrainConfig`` (the free-form ``[workload]`` keys are in
``config.model``, a dict, unless the function declares a ``Config`` dataclass) and it returns a
``Job``::

    from maestro import Job, Section

    def job(config):
        def student_fwd(module, samples, inputs):          # samples: list of dicts
            ...                                            # inputs["teacher"][i]: dict or None
            return [{"loss": per_sample_loss} for ...]     # summed over the sample's targets
        return Job(
            sections=[
                Section("teacher", lambda: MyTeacher(), frozen=True, forward=teacher_fwd),
                Section("student", lambda: MyStudent(), inputs=["teacher"], forward=student_fwd),
            ],
            dataset=maestro.data.JsonlDataset("train.jsonl"),   # any map-style dataset
        )

A section's module may be an ``nn.Module`` or a zero-argument factory; factories are called
only on the ranks that run the section, under a seed derived from ``(config.seed, name)``, so
a section starts from the same weights whatever the layout. The built-in ``kd`` and ``mllm``
workloads are job functions of this kind (``maestro.workloads.kd:job``,
``maestro.workloads.mllm:job``); nothing in the runtime, profiler, planner or simulator knows
them by name.

What the runtime needs from a job, with its default:

- the global batch of step ``s``: ``batches(s)`` if given, else ``config.global_batch``
  records of ``dataset`` in a seeded, per-epoch shuffled order that every rank computes alike
  (``shuffle=False``: file order); step ``s`` reads positions ``s*B .. (s+1)*B - 1`` of that
  endless sequence, so a resumed run continues where it stopped. ``collate(record)`` turns a
  record into a sample (dict of tensors); by default lists of numbers become tensors.
- the loss normaliser of a global batch: ``normaliser(batch)``, else the number of predicted
  tokens (``len(input_ids) - 1`` per sample, or ``labels != -100`` counted after the shift,
  or ``num_targets``), else the number of samples;
- per-sample cost features for the scheduler: ``sample_cost(sample)``, else ``tokens`` (the
  sample's sequence length), ``images`` and ``audio`` (1 when the sample has such a key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from maestro.schedule.types import SampleInfo
from maestro.sections import Sample, Section, SectionGraph
from maestro.seeding import seed_for

#: keys holding a sample's token ids, in the order the defaults look for them
TOKEN_KEYS = ("input_ids", "tokens")
#: label value ignored by the loss (PyTorch's and Hugging Face's convention)
IGNORE_INDEX = -100
IMAGE_KEYS = ("image", "pixel_values", "images")
AUDIO_KEYS = ("audio", "input_features", "audio_features")


def default_collate(record: dict) -> dict:
    """One dataset record as a sample: lists of numbers become tensors (int64 or float32)."""
    if not isinstance(record, dict):
        raise ValueError(f"a dataset record must be a dict, got {type(record).__name__}")
    out = {}
    for k, v in record.items():
        if isinstance(v, (list, tuple)) and v and _numeric(v):
            t = torch.tensor(v)
            out[k] = t.to(torch.float32) if t.is_floating_point() else t
        else:
            out[k] = v
    return out


def compute_dtype(config) -> torch.dtype:
    """The dtype sections compute in (``bfloat16`` runs fp32 master weights under autocast)."""
    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[
        config.dtype
    ]


def param_dtype(config, frozen: bool) -> torch.dtype:
    """The dtype a section's parameters are stored in.

    ``bfloat16``: trainable sections keep fp32 master weights (bf16 compute by autocast);
    frozen sections are bf16 end to end (no optimizer, half the memory).
    """
    if config.dtype == "bfloat16":
        return torch.bfloat16 if frozen else torch.float32
    return compute_dtype(config)


def _check_map_style(ds, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``ds`` is a non-empty map-style dataset."""
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ValueError(
            f"{where}: need a map-style dataset (__len__ and __getitem__), got {type(ds).__name__}"
        )
    if len(ds) == 0:
        raise ValueError(f"{where}: the dataset is empty")


def _numeric(v) -> bool:
    x = v
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _length(sample: Sample) -> int | None:
    for k in TOKEN_KEYS:
        v = sample.get(k)
        if isinstance(v, torch.Tensor):
            return int(v.shape[-1])
    return None


def default_normaliser(batch: Sequence[Sample]) -> float:
    """Predicted tokens of the batch (see the module docstring), else its sample count."""
    total = 0.0
    for s in batch:
        if "num_targets" in s:
            total += float(s["num_targets"])
        elif isinstance(s.get("labels"), torch.Tensor):
            total += float((s["labels"][..., 1:] != IGNORE_INDEX).sum())
        elif (n := _length(s)) is not None:
            total += n - 1
        else:
            total += 1.0
    return max(total, 1.0)


def default_sample_cost(sample: Sample) -> dict[str, float]:
    """``tokens`` (sequence length, 1 without one), ``images`` and ``audio`` (0 or 1)."""
    n = _length(sample)
    return {
        "tokens": float(n if n is not None else 1),
        "images": float(any(k in sample for k in IMAGE_KEYS)),
        "audio": float(any(k in sample for k in AUDIO_KEYS)),
    }


class Job:
    """A compound model (its sections) and its data.

    Args:
        sections: the sections (``maestro.Section``), any number, any DAG; each module an
            ``nn.Module`` or a zero-argument factory returning one.
        dataset: a map-style dataset (``__len__`` and ``__getitem__``: a
            ``torch.utils.data.Dataset``, a Hugging Face ``datasets.Dataset``, a list) of dict
            records. Either ``dataset`` or ``batches``.
        batches: ``batches(step) -> list of dict samples`` (the global batch of ``step``); for
            synthetic data generated per step. Must return the same batch on every rank.
        collate: ``collate(record) -> sample`` applied to each dataset record (default:
            ``default_collate``).
        normaliser: ``normaliser(batch) -> float``: what the summed per-sample losses of a
            global batch are divided by (default: ``default_normaliser``).
        sample_cost: ``sample_cost(sample) -> {feature: value}`` for the scheduler's cost model
            (default: ``default_sample_cost``).
        shuffle: reshuffle ``dataset`` every epoch (seeded by the run's seed); ``False`` reads
            it in order.
        order: ``order(epoch) -> list of dataset positions`` (a permutation): the read order
            of each epoch, e.g. length-grouped (``maestro.data.length_grouped_order``) with a
            fresh grouping per epoch; overrides ``shuffle``. Must be deterministic (the same
            on every rank: the ranks check it).
        cost_model: a ``maestro.costmodel.CostModel`` the run's scheduler prices micro-batches
            with (e.g. an analytical model of the real hardware), instead of the FLOP estimate
            counted on the ``meta`` device; a config's ``cost_profile`` still wins.
        eval_dataset: held-out records (map-style, collated like ``dataset``) that the run
            config's ``[eval]`` table evaluates every ``every`` steps; ``[eval] data`` (a JSONL
            file) replaces it for a ``maestro.data.JsonlDataset`` job.
        tokenizer: the tokenizer of the job's text (a local directory or a tokenizer object);
            ``maestro export`` writes its files beside a Hugging Face section's weights.
            Default: the dataset's (``maestro.data.JsonlDataset(tokenizer=)``), if any.
    """

    def __init__(
        self,
        sections: Sequence[Section],
        *,
        dataset: Any = None,
        batches: Callable[[int], Sequence[Sample]] | None = None,
        collate: Callable[[Any], Sample] | None = None,
        normaliser: Callable[[Sequence[Sample]], float] | None = None,
        sample_cost: Callable[[Sample], dict[str, float]] | None = None,
        shuffle: bool = True,
        order: Callable[[int], Sequence[int]] | None = None,
        cost_model: Any = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
    ) -> None:
        sections = list(sections)
        if not sections:
            raise ValueError("Job(sections=...): a job needs at least one section")
        for s in sections:
            if not isinstance(s, Section):
                raise ValueError(f"Job(sections=...): expected maestro.Section, got {type(s)}")
        if (dataset is None) == (batches is None):
            raise ValueError("Job: give exactly one of dataset= (records) or batches= (a function)")
        if dataset is not None:
            _check_map_style(dataset, "Job(dataset=...)")
        self.sections = sections
        self.dataset = dataset
        self._batches = batches
        self.collate = collate or default_collate
        self._normaliser = normaliser or default_normaliser
        self._sample_cost = sample_cost or default_sample_cost
        self.shuffle = shuffle
        self._order = order
        self.cost_model = cost_model
        self.eval_dataset = eval_dataset
        self.tokenizer = tokenizer
        self.config = None
        self._orders: dict[int, list[int]] = {}

    # -- set by the runtime -------------------------------------------------------------------
    def bind(self, config) -> Job:
        """Attach the run config (seed, batch size, dtype, which sections are frozen)."""
        self.config = config
        by_name = {s.name: s for s in self.sections}
        for name, sc in config.sections.items():
            if name in by_name and sc.frozen is not None:
                by_name[name].frozen = bool(sc.frozen)
            if name in by_name and sc.inputs is not None:
                by_name[name].inputs = tuple(sc.inputs)
        return self

    @property
    def structure(self) -> dict[str, tuple[list[str], bool]]:
        """``name -> (inputs, frozen)`` as the job declares them."""
        return {s.name: (list(s.inputs), s.frozen) for s in self.sections}

    # -- the workload interface the runtime, profiler and planner use -------------------------
    def build_module(self, name: str) -> nn.Module:
        """Section ``name``'s module: built (factory) under its seed, in the run's dtype."""
        sec = self._section(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for("init", self.config.seed, name))
            module = sec.module() if not isinstance(sec.module, nn.Module) else sec.module
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"section {name!r}: its factory returned {type(module).__name__}, not an nn.Module"
            )
        module = module.to(param_dtype(self.config, sec.frozen))
        if sec.frozen:
            module.requires_grad_(False).eval()
        else:
            _warn_dropout(name, module)
        return module

    def graph(self, build: Iterable[str] | None = None) -> SectionGraph:
        """The section graph; modules are built for the names in ``build`` (default: all).

        Sections not built get an empty ``nn.Module`` placeholder: a rank only needs its own
        section's weights, and the rest of the graph for routing.
        """
        names = [s.name for s in self.sections]
        build = set(names if build is None else build)
        bf16 = self.config.dtype == "bfloat16"
        out = []
        for s in self.sections:
            module = self.build_module(s.name) if s.name in build else nn.Module()
            sec = s.clone(module)
            if bf16:
                sec.autocast_dtype = torch.bfloat16
                sec.input_dtype = torch.bfloat16 if s.frozen else None
            elif self.config.dtype == "float64":
                # the default collate makes float lists float32; a float64 run's modules
                # take float64 inputs (integer ids untouched)
                sec.input_dtype = torch.float64
            out.append(sec)
        return SectionGraph(out)

    def batch(self, step: int) -> list[Sample]:
        """Global batch of ``step``: ``config.global_batch`` samples with ``"id"`` 0..B-1."""
        b = self.config.global_batch
        if self._batches is not None:
            got = list(self._batches(step))
            if len(got) != b:
                raise ValueError(
                    f"Job.batches({step}) returned {len(got)} samples; global_batch is {b}"
                )
            raw = got
        else:
            raw = [self.collate(self.dataset[i]) for i in self.indices(step)]
        out = []
        for i, s in enumerate(raw):
            if not isinstance(s, dict):
                raise ValueError(f"step {step}: sample {i} is a {type(s).__name__}, not a dict")
            out.append({**s, "id": i})
        return out

    def check_batch_fits(self) -> None:
        """``ValueError`` (one line) when the dataset holds fewer records than one global
        batch: a step would read some records twice. A job with ``batches=`` passes."""
        if self.dataset is None:
            return
        n, b = len(self.dataset), self.config.global_batch
        if n < b:
            raise ValueError(
                f"global_batch: the dataset has {n} record{'s' if n != 1 else ''} but "
                f"global_batch = {b}, so one step would read some records twice; lower "
                f"global_batch to at most {n} or add records"
            )

    def describe_sample(self, step: int, sample_id: int) -> str:
        """Where step ``step``'s sample ``sample_id`` came from, for an error message:
        ``" of step 3 (dataset record 17, train.jsonl:18)"`` (the file for a JSONL dataset)."""
        out = f" of step {step}"
        if self.dataset is None or not isinstance(sample_id, int):
            return out
        try:
            pos = self.indices(step)[sample_id]
        except (IndexError, ValueError):
            return out
        lines, path = (
            getattr(self.dataset, "line_numbers", None),
            getattr(self.dataset, "path", None),
        )
        at = f", {path}:{lines[pos]}" if lines is not None and path is not None else ""
        return f"{out} (dataset record {pos}{at})"

    def indices(self, step: int) -> list[int]:
        """Dataset positions of step ``step``'s samples (deterministic, the same on every rank)."""
        self.check_batch_fits()
        n, b = len(self.dataset), self.config.global_batch
        start = step * b
        out = []
        while len(out) < b:
            epoch, pos = divmod(start + len(out), n)
            order = self._epoch_order(epoch)
            take = min(b - len(out), n - pos)
            out += order[pos : pos + take]
        return out

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            n = len(self.dataset)
            if self._order is not None:
                got = [int(i) for i in self._order(epoch)]
                if sorted(got) != list(range(n)):
                    raise ValueError(
                        f"Job(order=...): epoch {epoch}'s order is not a permutation of the "
                        f"{n} dataset positions"
                    )
                self._orders = {epoch: got}
            elif self.shuffle:
                g = torch.Generator().manual_seed(seed_for("data order", self.config.seed, epoch))
                self._orders = {epoch: torch.randperm(n, generator=g).tolist()}
            else:
                self._orders = {epoch: list(range(n))}
        return self._orders[epoch]

    def sample_infos(self, batch: Sequence[Sample], graph: SectionGraph) -> list[SampleInfo]:
        """What a scheduler needs about each sample: the sections it activates and its cost."""
        return [
            SampleInfo(
                sample_id=s["id"],
                sections=frozenset(sec.name for sec in graph if sec.activated(s)),
                cost=self._sample_cost(s),
            )
            for s in batch
        ]

    def sample_cost(self, sample: Sample) -> dict[str, float]:
        """The scheduler's cost features of one sample (``Job(sample_cost=)`` or the default)."""
        return self._sample_cost(sample)

    def normaliser(self, batch: Sequence[Sample]) -> float:
        """What the summed per-sample losses of ``batch`` are divided by (> 0)."""
        v = float(self._normaliser(batch))
        if not v > 0:
            raise ValueError(f"the job's normaliser returned {v}; it must be > 0")
        return v

    def _section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise ValueError(f"the job has no section {name!r}")


def _warn_dropout(name: str, module: nn.Module) -> None:
    """Say once per section that dropout makes the loss depend on the layout.

    The rule: a run is reproducible for a given layout and scheduler (every rank's RNG
    starts from torch's fixed default seed and consumes it in schedule order), but dropout
    masks are drawn per micro-batch, so another layout draws other, equally valid masks and
    its losses differ. For exactness checks (Maestro vs ``--monolithic`` vs a plain loop)
    build the modules with dropout 0, as the built-in jobs and ``maestro.hf`` do by default.
    """
    import sys

    ps = sorted(
        {
            m.p
            for m in module.modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
        }
    )
    if ps:
        print(
            f"maestro: section {name!r} has dropout (p={', '.join(f'{p:g}' for p in ps)}): its "
            "losses are reproducible for this layout, not equal across layouts (set dropout "
            "to 0 to compare layouts exactly)",
            file=sys.stderr,
            flush=True,
        )


def resolve_job_function(name: str, base_dir: str | None = None) -> Callable:
    """Import a job function; ``ValueError`` (one line) when it cannot be.

    ``name`` is ``"package.module:function"`` (importable, or a module file in ``base_dir``,
    the run config's directory) or ``"path/to/file.py:function"`` (relative to ``base_dir``).
    """
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    mod, sep, fn = name.rpartition(":")
    if not sep or not mod or not fn:
        raise ValueError(f'workload.name: {name!r} is not of the form "package.module:function"')
    if mod.endswith(".py"):
        path = Path(mod)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ValueError(f"workload.name: job file {path} does not exist")
        key = f"maestro_job_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(key)
        if module is None:
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            try:
                spec.loader.exec_module(module)
            except Exception:
                del sys.modules[key]
                raise
    else:
        if base_dir is not None and str(base_dir) not in sys.path:
            # a job module next to the run config imports like a script's neighbour
            sys.path.insert(0, str(base_dir))
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"workload.name: cannot import module {mod!r} ({e})") from None
    try:
        obj = getattr(module, fn)
    except AttributeError:
        raise ValueError(f"workload.name: module {mod!r} has no function {fn!r}") from None
    if not callable(obj):
        raise ValueError(f"workload.name: {name!r} is not callable")
    return obj


def call_job_function(fn: Callable, config) -> Job:
    """``fn(config)``, checked to return a ``Job``."""
    job = fn(config)
    if not isinstance(job, Job):
        raise ValueError(
            f"workload.name: {config.workload!r} returned {type(job).__name__}, not a maestro.Job"
        )
    return job


__all__ = [
    "IGNORE_INDEX",
    "Job",
    "call_job_function",
    "default_collate",
    "default_normaliser",
    "default_sample_cost",
    "resolve_job_function",
]


def eval_dataset(job, config):
    """The eval records of ``config.eval`` for ``job`` (read once per job, then cached).

    ``ValueError`` (one line, naming the field) when there are none or they cannot be read.
    """
    ev = config.eval
    key = None if ev.data is None else str(ev.data_path(config.config_dir))
    cached = getattr(job, "_maestro_eval", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    own = getattr(job, "eval_dataset", None)
    if key is not None:
        from maestro.data.jsonl import JsonlDataset

        train = getattr(job, "dataset", None)
        if not isinstance(train, JsonlDataset):
            what = "generates its batches" if train is None else f"reads a {type(train).__name__}"
            raise ValueError(
                f"eval.data: the job {what}, not a maestro.data.JsonlDataset, so {key} cannot "
                "be read like its training data; remove eval.data and set job.eval_dataset in "
                "the job function"
            )
        ds = train.with_path(key)
    elif own is not None:
        ds = own
        _check_map_style(ds, "eval: job.eval_dataset")
    else:
        raise ValueError(
            "eval.data: missing; name a JSONL file of eval records (for a JsonlDataset job) or "
            "set job.eval_dataset in the job function"
        )
    job._maestro_eval = (key, ds)
    return ds
