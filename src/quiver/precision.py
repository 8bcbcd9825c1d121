"""Serving precision as a measured choice: fp32 or bf16 per stage (feature gather, model).

bf16 halves the bytes a gather moves, and oneDNN runs bf16 GEMMs on AMX or AVX-512-BF16
units several times faster than fp32 where a CPU has them; where it does not, bf16 GEMMs are
emulated and slower. So ``--precision auto`` does not guess: :func:`measure_precision` times
both stages in both precisions on sampled batches of the served graph, on this machine, and
keeps per stage the faster one (bf16 only when it wins by a margin and its answers agree with
fp32). :func:`write_precision` records the choice with the machine it was measured on
(:func:`machine`: the CPU's model name, its bf16-relevant feature flags and the cores this
process may use) in the dataset's ``manifest.json`` (under ``"precision"``, beside the PSGS
``"calibration"``); :func:`read_precision` reuses it on the next start on the same machine, for
the same weights (:func:`weights_id`) and fanouts, and returns nothing otherwise, which then
measures again. The model name alone does not do: "AMD EPYC" names EPYCs with and without
AVX-512-BF16 units. The entry keeps one record per (machine, weights, fanouts), the
:data:`KEEP_RECORDS` most recent, so serving another model on the dataset never overwrites
this one's decision (the ``"fold"`` decisions, ``quiver.serving.folded``, are kept the same way).

Logits and embeddings leave the model in fp32 whatever runs inside (:class:`PrecisionModel`).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "PRECISIONS",
    "STAGES",
    "PrecisionChoice",
    "PrecisionModel",
    "cpu_cores",
    "cpu_flags",
    "cpu_model",
    "machine",
    "measure_precision",
    "model_id",
    "read_precision",
    "same_machine",
    "sampled_batches",
    "stored_records",
    "update_manifest",
    "weights_id",
    "write_precision",
]

#: values of ``--precision``
PRECISIONS = ("auto", "fp32", "bf16")
#: the stages a choice covers
STAGES = ("gather", "model")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: measured decisions a manifest entry keeps (one per machine, weights and fanouts)
KEEP_RECORDS = 8


def cpu_model() -> str:
    """This machine's CPU model: ``lscpu``'s "Model name", else /proc/cpuinfo's "model name",
    else ``platform.processor()`` (``"unknown"`` when none answers)."""
    import subprocess

    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=5, env={**os.environ, "LC_ALL": "C"}
        ).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name" and value.strip():
                return value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: /proc/cpuinfo flags that decide how fast bf16 (and fp32) runs: oneDNN's AVX-512, AVX-512-BF16
#: and AMX kernels (AVX2 alone emulates bf16 GEMMs)
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags() -> list[str]:
    """The :data:`BF16_FLAGS` this CPU reports in /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                have = set(value.split())
                return [f for f in BF16_FLAGS if f in have]
    except OSError:
        pass
    return []


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask; ``os.cpu_count()`` where none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def machine() -> dict:
    """What a measured decision holds for: ``{"cpu_model", "cpu_flags", "cpu_cores"}``."""
    return {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "cpu_cores": cpu_cores()}


def same_machine(record: dict, here: dict | None = None) -> bool:
    """Whether ``record`` (a stored decision's fields) was measured on ``here`` (default:
    :func:`machine`); a record without flags or cores (stored before they were) is not."""
    here = machine() if here is None else here
    return all(record.get(k) is not None and record.get(k) == v for k, v in here.items())


def model_id(model: nn.Module) -> str:
    """A short fingerprint of a model's architecture: class, parameter count, tensor count."""
    inner = getattr(model, "module", model)
    params = list(model.parameters())
    return f"{type(inner).__name__}:{sum(p.numel() for p in params)}:{len(params)}"


def weights_id(model: nn.Module) -> str:
    """The checkpoint's content as served: a sha256 (16 hex digits) over the model's
    ``state_dict`` (names, dtypes, shapes and bytes), so two checkpoints of one architecture
    with other weights differ and a copy of a file does not."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class PrecisionChoice:
    """The precision of each serving stage, as measured (or asked for).

    Attributes:
        gather: ``"fp32"`` or ``"bf16"``: the dtype feature rows are stored and gathered in.
        model: ``"fp32"`` or ``"bf16"``: the dtype of the model's weights and activations.
        cpu_model: the CPU it was measured on (:func:`cpu_model`); empty when not measured.
        cpu_flags: that CPU's :data:`BF16_FLAGS` (:func:`cpu_flags`); None in a record
            written before they were stored (then measured again).
        cpu_cores: cores the measuring process could use (:func:`cpu_cores`).
        model_id: the model it was measured for (:func:`model_id`); another model measures
            again.
        weights: the weights it was measured with (:func:`weights_id`); other weights (another
            checkpoint) measure again. Empty in a record stored before it was kept.
        sizes: the fanouts of the measured samples; other fanouts measure again.
        timings: ``{"gather": {"fp32": s, "bf16": s}, "model": {...}}``: summed seconds over
            the measured batches (model: fed rows of its chosen gather dtype).
        agreement: share of the measured seeds whose bf16-model argmax equals fp32's.
        max_abs_diff: largest |bf16 - fp32| logit over those seeds.
        batch_sizes: seeds per measured batch; ``repeats`` batches of each.
        torch_threads: intra-op threads of the model timings.
        note: why a stage stayed fp32 (e.g. the bf16 model failed), else empty.
        created: UTC timestamp.
    """

    gather: str = "fp32"
    model: str = "fp32"
    cpu_model: str = ""
    cpu_flags: list | None = None
    cpu_cores: int | None = None
    model_id: str = ""
    weights: str = ""
    sizes: list | None = None
    timings: dict = field(default_factory=dict)
    agreement: float | None = None
    max_abs_diff: float | None = None
    batch_sizes: list = field(default_factory=list)
    repeats: int = 0
    torch_threads: int = 1
    note: str = ""
    created: str = ""

    def __post_init__(self):
        for stage in STAGES:
            value = getattr(self, stage)
            if value not in DTYPES:
                raise ValueError(f"precision {stage} must be fp32 or bf16, got {value!r}")

    @classmethod
    def fixed(cls, precision: str) -> PrecisionChoice:
        """Both stages in ``precision`` (``"fp32"`` or ``"bf16"``), not measured."""
        if precision not in DTYPES:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
        return cls(gather=precision, model=precision)

    def describe(self) -> str:
        """One line: ``gather bf16, model fp32 (measured on AMD EPYC, avx2, 16 cores)``."""
        where = f" (measured on {self.where()})" if self.cpu_model else ""
        return f"gather {self.gather}, model {self.model}{where}"

    def where(self) -> str:
        """The machine it was measured on: ``AMD EPYC, avx2, 16 cores``."""
        flags = ", ".join(self.cpu_flags or []) or "no AVX2/AVX-512/AMX"
        cores = f", {self.cpu_cores} cores" if self.cpu_cores else ""
        return f"{self.cpu_model}, {flags}{cores}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> PrecisionChoice:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


class PrecisionModel(nn.Module):
    """A served model run in bf16 (or fp32) whose outputs are fp32.

    Casts the gathered rows to the model's dtype, runs ``forward_all`` / ``forward``, and
    returns fp32 tensors. Built by :meth:`wrap`, which converts a *copy* of the model's
    weights, so the fp32 model it came from stays as it was.

    Args:
        module: a model with ``forward_all(x, adjs)`` (``SampledGNN`` or ``ServedModel``).
        dtype: the dtype its weights are in and its inputs are cast to.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.dtype = dtype
        self.has_embedding = bool(getattr(module, "has_embedding", True))

    @classmethod
    def wrap(cls, model: nn.Module, dtype: torch.dtype, rows: torch.dtype = torch.float32):
        """``model`` as it is for fp32 on fp32 ``rows`` (the gathered features' dtype); a
        casting wrapper around it for fp32 on bf16 rows; else a wrapper around a copy whose
        weights are converted to ``dtype``."""
        if dtype == torch.float32:
            return model if rows == torch.float32 else cls(model, dtype)
        return cls(copy.deepcopy(model).to(dtype), dtype)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward_all(self, x, adjs):
        emb, logits = self.module.forward_all(x.to(self.dtype), adjs)
        return (emb.float() if emb is not None else None), logits.float()

    def forward(self, x, adjs):
        return self.module(x.to(self.dtype), adjs).float()


# ------------------------------------------------------------------------------ measurement


def sampled_batches(sampler, node_count: int, batch_sizes, repeats: int, rng) -> list:
    """``[(n_id, adjs)]``: ``repeats`` sampled batches per size in ``batch_sizes``, each of
    distinct random seeds (sorted) drawn with ``rng``; what start-up measurements time."""
    batches = []
    for b in batch_sizes:
        for _ in range(repeats):
            seeds = rng.choice(node_count, size=min(int(b), node_count), replace=False)
            n_id, _, adjs = sampler.sample(torch.from_numpy(np.sort(seeds)))
            batches.append((n_id, adjs))
    return batches


def measure_precision(
    sampler,
    features: torch.Tensor,
    model: nn.Module,
    node_count: int,
    batch_sizes=(32, 256),
    repeats: int = 3,
    seed: int = 0,
    num_threads: int = 1,
    margin: float = 0.05,
    min_agreement: float = 0.99,
) -> PrecisionChoice:
    """Time the gather and the model in fp32 and bf16 on sampled batches; keep the faster.

    For each of ``repeats`` batches of each size in ``batch_sizes`` (distinct random seeds),
    one sample is drawn and, after a warm-up, both gathers (rows of an fp32 and a bf16 table)
    and the model in each of the four (gather, model) pairings are timed once, alternating
    which precision goes first. The pair of the smallest summed gather + model time wins,
    except that bf16 is kept for a stage only when it cuts the measured total by more than
    ``margin`` (so a CPU without bf16 units stays at fp32) and a bf16 model only when its
    argmax agrees with fp32 on at least ``min_agreement`` of the seeds.

    Args:
        sampler: ``sample(seeds) -> (n_id, batch_size, adjs)`` (the server's sampler).
        features: the stored ``[N, F]`` rows (fp32 or bf16, CPU); the other dtype is made
            once by converting them (memory: one more table while this runs).
        model: the fp32 model (``forward_all``), on the CPU.
        node_count: nodes to draw seeds from.
        batch_sizes: seeds per batch.
        repeats: batches per size.
        seed: RNG seed of the seeds.
        num_threads: torch intra-op threads (the serving engine's ``torch_threads``).
        margin: relative time bf16 must save to be chosen.
        min_agreement: argmax agreement a bf16 model must reach.

    Returns:
        A :class:`PrecisionChoice` with this CPU's model name and the timings.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    tables = {
        "fp32": features if features.dtype == torch.float32 else features.float(),
        "bf16": features if features.dtype == torch.bfloat16 else features.to(torch.bfloat16),
    }
    note = ""
    models = {"fp32": PrecisionModel.wrap(model, torch.float32, torch.bfloat16)}  # casts rows
    try:
        models["bf16"] = PrecisionModel.wrap(model, torch.bfloat16)
    except Exception as e:  # a user model that cannot be converted
        note = f"bf16 model unavailable: {type(e).__name__}: {e}"
    rng = np.random.default_rng(seed)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    gather_t = {p: 0.0 for p in DTYPES}
    pair_t = {(g, m): 0.0 for g in DTYPES for m in models}  # model time per (gather, model)
    agree = total = 0
    max_diff = 0.0
    try:
        with torch.inference_mode():
            batches = sampled_batches(sampler, node_count, batch_sizes, repeats, rng)
            # warm-up: one-off costs (first-touch pages, oneDNN kernel creation)
            n_id, adjs = batches[0]
            for tab in tables.values():
                for m, net in list(models.items()):
                    try:
                        net.forward_all(tab[n_id], adjs)
                    except Exception as e:
                        if m == "fp32":
                            raise
                        note = f"bf16 model failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                        del models[m]
                        for key in [k for k in pair_t if k[1] == m]:
                            del pair_t[key]
            for i, (n_id, adjs) in enumerate(batches):
                order = list(DTYPES) if i % 2 == 0 else list(DTYPES)[::-1]
                xs = {}
                for g in order:
                    t0 = time.perf_counter()
                    xs[g] = tables[g][n_id]
                    gather_t[g] += time.perf_counter() - t0
                outs = {}
                for m in [m for m in order if m in models]:
                    for g in order:
                        t0 = time.perf_counter()
                        _, logits = models[m].forward_all(xs[g], adjs)
                        pair_t[(g, m)] += time.perf_counter() - t0
                        outs[(g, m)] = logits
                if "bf16" in models:
                    ref, low = outs[("fp32", "fp32")], outs[("bf16", "bf16")]
                    agree += int((ref.argmax(1) == low.argmax(1)).sum())
                    total += ref.shape[0]
                    max_diff = max(max_diff, float((ref - low.float()).abs().max()))
    finally:
        torch.set_num_threads(prev_threads)
    agreement = agree / total if total else None
    if "bf16" in models and agreement is not None and agreement < min_agreement:
        note = f"bf16 model argmax agreement {agreement:.4f} < {min_agreement}"
        pair_t = {k: v for k, v in pair_t.items() if k[1] == "fp32"}

    def cost(pair) -> float:
        return gather_t[pair[0]] + pair_t[pair]

    def pays(pair) -> bool:
        # every bf16 stage must pay for itself: beat the same pair with that stage in fp32
        for i, p in enumerate(pair):
            if p == "bf16":
                without = tuple("fp32" if j == i else q for j, q in enumerate(pair))
                if not cost(pair) < (1 - margin) * cost(without):
                    return False
        return True

    best = next((pair for pair in sorted(pair_t, key=cost) if pays(pair)), ("fp32", "fp32"))
    g, m = best
    return PrecisionChoice(
        gather=g,
        model=m,
        **machine(),
        model_id=model_id(model),
        weights=weights_id(model),
        sizes=[int(k) for k in getattr(sampler, "sizes", [])] or None,
        timings={
            "gather": dict(gather_t),
            "model": {mm: pair_t[(g, mm)] for mm in models if (g, mm) in pair_t},
            "pairs": {f"{a}+{b}": cost((a, b)) for a, b in pair_t},
        },
        agreement=agreement,
        max_abs_diff=max_diff if total else None,
        batch_sizes=[int(b) for b in batch_sizes],
        repeats=int(repeats),
        torch_threads=int(num_threads),
        note=note,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


# ------------------------------------------------------------------------------ manifest


def update_manifest(manifest_path, key: str, value, drop: tuple = ()) -> None:
    """Set ``key`` (and remove the ``drop`` keys) in a manifest.json, atomically (temp +
    rename)."""
    p = Path(manifest_path)
    if p.is_dir():
        p = p / "manifest.json"
    manifest = json.loads(p.read_text()) if p.exists() else {}
    manifest[key] = value
    for k in drop:
        manifest.pop(k, None)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, p)


def stored_records(manifest: dict, key: str) -> list[dict]:
    """The records a manifest entry holds, oldest first: a list of dicts, or one dict (as
    stored before decisions were kept per model)."""
    value = manifest.get(key)
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return [d for d in value if isinstance(d, dict)]
    return []


def update_records(manifest_path, key: str, record: dict, same, drop=None) -> None:
    """Append ``record`` to the manifest's ``key`` records in place of those ``same(r)`` says
    it replaces, keeping the :data:`KEEP_RECORDS` newest; with ``drop``, ``{other key:
    predicate}``, also remove the other entries' records the predicate names. Atomic (temp +
    rename)."""
    p = Path(manifest_path)
    if p.is_dir():
        p = p / "manifest.json"
    manifest = json.loads(p.read_text()) if p.exists() else {}
    kept = [r for r in stored_records(manifest, key) if not same(r)]
    manifest[key] = [*kept, record][-KEEP_RECORDS:]
    for other, gone in (drop or {}).items():
        if other in manifest:
            left = [r for r in stored_records(manifest, other) if not gone(r)]
            if left:
                manifest[other] = left
            else:
                manifest.pop(other)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, p)


def _precision_key(d: dict) -> tuple:
    sizes = d.get("sizes")
    return (
        d.get("cpu_model"),
        d.get("cpu_flags"),
        d.get("cpu_cores"),
        d.get("model_id"),
        d.get("weights") or "",
        [int(k) for k in sizes] if sizes else None,
    )


def write_precision(manifest_path, choice: PrecisionChoice) -> None:
    """Store ``choice`` among the ``"precision"`` records of a manifest.json, atomically, in
    place of a record for the same machine, weights and fanouts (the others stay).

    The ``"fold"`` decisions (``quiver.serving.folded.FoldChoice``) measured for the same
    weights on this machine were measured on top of the precision before, so they are
    removed: the next start of that model measures its fold again.
    """
    record = choice.to_json()
    key = _precision_key(record)

    where = {k: record[k] for k in ("cpu_model", "cpu_flags", "cpu_cores")}

    def same_weights_here(d: dict) -> bool:
        same_weights = (d.get("weights") or "") == (record["weights"] or "")
        return same_weights and same_machine(d, where)

    update_records(
        manifest_path,
        "precision",
        record,
        same=lambda d: _precision_key(d) == key,
        drop={"fold": same_weights_here},
    )


def read_precision(
    manifest: dict,
    here: dict | None = None,
    model: nn.Module | None = None,
    weights: str | None = None,
    sizes=None,
) -> PrecisionChoice | None:
    """The newest measured choice in ``manifest`` measured on ``here`` (default: this
    :func:`machine`: CPU model, bf16 flags, cores) and, when given, for a model of the same
    :func:`model_id`, the same weights (``weights``, default :func:`weights_id` of ``model``)
    and the same fanouts (``sizes``); else None (no answer for this machine and model: measure
    again). A record without weights (stored before they were kept) answers for none."""
    if model is not None and weights is None:
        weights = weights_id(model)
    want_sizes = [int(k) for k in sizes] if sizes is not None else None
    for d in reversed(stored_records(manifest, "precision")):
        try:
            choice = PrecisionChoice.from_json(d)
        except (TypeError, ValueError):
            continue
        if not same_machine(d, here):
            continue
        if model is not None and choice.model_id and choice.model_id != model_id(model):
            continue
        if weights is not None and choice.weights != weights:
            continue
        if want_sizes is not None and choice.sizes is not None and choice.sizes != want_sizes:
            continue
        return choice
    return None
