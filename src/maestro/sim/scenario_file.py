"""Scenario files: the user's own compound workload, for planning it at scale.

A scenario file is TOML with a ``[scenario]`` table and one ``[sections.NAME]`` table per
section (a file whose ``[scenario]`` table has no ``[sections]`` beside it names a built-in
scenario instead: ``maestro.plan.workload.ScenarioSpec``)::

    [scenario]
    hardware = "H100"          # analytical GPU preset: H100 (h100-sxm), H200, A100 (a100-80g)
    global_batch = 2048        # samples per step, the same for every GPU budget
    gpus = 256                 # default budget (maestro plan --gpus overrides)
    seed = 0                   # seed of the synthetic batch

    [modalities]               # each modality's share of the samples (the rest: none)
    image = 0.7

    [sections.vision]
    model = "vit-0.6b"         # a preset (PRESETS) or a Hugging Face config.json path
    runs_on = "image"          # a modality, a list of them, or "all" (default)
    tokens = {dist = "lognormal", mean = 1024, sigma = 1.0, max = 16384}
    out_ratio = 0.25           # consumer tokens per own token (2x2 patch merge)

    [sections.llm]
    model = "qwen2.5-7b"
    inputs = ["vision"]
    tokens_from = "data.jsonl:text_tokens"   # measured from the user's data

``build(load(path))`` returns the same ``Scenario`` (``SampleInfo`` list, ``SectionSpec``
list with ``dp`` proportional to each section's work, ``AnalyticalCostModel``) as
``maestro.sim.scenarios.build``, so ``maestro plan FILE`` and ``maestro simulate FILE`` run
it exactly as a built-in scenario. Every mistake is a one-line ``ValueError`` naming the
file, the table and the key.

How a sample's costs are made (``SECTION_KEYS`` documents each key):

- Each sample gets one modality (exact shares of the batch, positions shuffled by ``seed``;
  the samples left over have none); a section runs on the samples of its ``runs_on``.
- A section's *own* token count comes from ``tokens`` (a number; a distribution; another
  section's name: the same counts) or ``tokens_from`` (values of a field of a JSON-lines
  file, sampled with replacement: one line per sample, shared by every section reading that
  file). Its *positions* are its own tokens plus, for each input section that ran on the
  sample, ``out_ratio`` times that input's positions (an encoder's tokens entering an LLM).
- The last decoder (a model with a vocabulary) in the graph owns the batch's ``tokens``
  cost key (token budgets, samplers and causal attention are priced on it); every other
  decoder with the same counts on the samples it runs on shares it. Any other section is
  priced on keys of its own (``NAME:tokens``, and ``NAME:sq`` for attention within
  ``attend_within``-token chunks): bidirectional attention, as an encoder runs.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from maestro.costmodel import AnalyticalCostModel, GPUPreset, SectionShape, preset
from maestro.estimate.models import PRESETS as ESTIMATE_PRESETS
from maestro.estimate.models import ModelSpec, from_hf_config
from maestro.schedule.types import SampleInfo, SectionSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Model presets a section's ``model`` may name: ``maestro.estimate``'s (published
#: config.json shapes) and the shapes of ``maestro.sim.scenarios``' built-in workloads.
PRESETS: dict[str, ModelSpec] = {
    **ESTIMATE_PRESETS,
    # mllm-vl's dynamic-resolution ViT (Qwen2-VL's vision tower: 32 x 1280, 16 heads)
    "vit-0.6b": ModelSpec("vit-0.6b", 32, 1280, 16, 16, 5120, 0, gated=False, causal=False),
    # mllm-audio's encoder (Whisper-medium's encoder: 24 x 1024, 16 heads, ffn 4096)
    "whisper-like": ModelSpec("whisper-like", 24, 1024, 16, 16, 4096, 0, gated=False, causal=False),
    # the light scenarios' ~7B LLM / student and ~34B teacher (scenarios.SHAPES)
    "llm-7b": ModelSpec("llm-7b", 32, 4096, 32, 32, 16512, 32000, gated=False),
    "teacher-34b": ModelSpec("teacher-34b", 64, 5120, 40, 40, 41472, 152064, gated=False),
}

#: ``[scenario]`` keys and what each means.
SCENARIO_KEYS = {
    "hardware": "analytical GPU preset (maestro.costmodel.GPU_PRESETS: H100 or h100-sxm, "
    "H200, A100 or a100-80g, H100-96G-500W); required",
    "global_batch": "samples per step, the same for every GPU budget; required",
    "gpus": "default GPU budget (maestro plan --gpus overrides; default 8)",
    "seed": "seed of the synthetic batch (default 0)",
    "label": "name printed in reports (default: the file's stem)",
}

#: ``[sections.NAME]`` keys and what each means.
SECTION_KEYS = {
    "model": "a preset (maestro.sim.scenario_file.PRESETS) or a Hugging Face config.json "
    "(a file or a directory holding one, relative to the scenario file; read as JSON, no "
    "code runs); required",
    "frozen": "forward-only (no gradients, no optimizer); default false",
    "inputs": "the sections whose per-sample outputs it reads; default none",
    "runs_on": 'a modality of [modalities], a list of them, or "all" (default)',
    "tokens": "its own tokens per sample: a number, a distribution "
    '({dist = "lognormal", mean = M, sigma = S, max = X [, min = 1]}, mean before '
    'clipping, or median = instead of mean; {dist = "uniform", min, max}), or another '
    "section's name (the same counts); this or tokens_from is required",
    "tokens_from": '"FILE.jsonl:FIELD": each line a JSON object; FIELD a number, or a '
    "string or list whose length counts (lines without it are skipped); FILE relative to "
    "the scenario file",
    "tokens_scale": "multiplies what tokens_from reads (e.g. 0.25 tokens per character of "
    "text); default 1",
    "out_ratio": "positions it adds to each consumer per own position (default 1 for an "
    "encoder, 0 for a decoder, which sends per-token outputs such as logits)",
    "out_bytes_per_token": "bytes sent to a consumer per own position (default: "
    "out_ratio bf16 vectors of the widest consumer, or one bf16 hidden state of its own "
    "when out_ratio is 0; 384 for top-64 logits)",
    "attend_within": "attention runs within chunks of this many of its own tokens (an "
    "image tile); default the whole sample; for sections priced on keys of their own",
    "micro_batch_size": "micro-batch size of the starting layout (the planner chooses its "
    "own); default 1",
    "token_budget": "at most this many of the batch's tokens (the last decoder's "
    "positions) per micro-batch, in every layout the planner tries; default none",
    "tp_plan": "the runtime can split it tensor-parallel (default: true for a decoder, "
    "false for an encoder, as maestro.parallel has no TP plan for vision or audio towers)",
}
_DISTS = {
    "lognormal": ({"dist", "max"}, {"mean", "median", "sigma", "min"}),
    "uniform": ({"dist", "min", "max"}, set()),
}


@dataclass(frozen=True)
class TokenSpec:
    """Where a section's own per-sample token counts come from (exactly one kind).

    Args:
        fixed: every sample has this many.
        dist: ``"lognormal"`` or ``"uniform"``, with ``params``.
        params: the distribution's parameters (``mean`` or ``median``, ``sigma``, ``min``,
            ``max``).
        same_as: another section's name: its positions, sample by sample.
        values: measured counts (``tokens_from``), sampled with replacement.
        lines: for every (non-empty) line of the data file, the index of its count in
            ``values``, or -1 when the line lacks the field.
        source: the data file the ``values`` come from (sections reading one file draw
            the same line for a sample).
    """

    fixed: int | None = None
    dist: str = ""
    params: dict = field(default_factory=dict)
    same_as: str = ""
    values: tuple[int, ...] = ()
    lines: tuple[int, ...] = ()
    source: str = ""


@dataclass(frozen=True)
class SectionEntry:
    """One ``[sections.NAME]`` table, parsed (``SECTION_KEYS`` says what each field means)."""

    name: str
    model: ModelSpec
    tokens: TokenSpec
    frozen: bool = False
    inputs: tuple[str, ...] = ()
    runs_on: tuple[str, ...] | None = None  # None: every sample
    out_ratio: float | None = None
    out_bytes_per_token: float | None = None
    attend_within: int | None = None
    micro_batch_size: int = 1
    token_budget: int | None = None
    tp_plan: bool | None = None

    @property
    def decoder(self) -> bool:
        """A model with a vocabulary (an LM head): causal, and owns ``tokens`` when last."""
        return self.model.vocab > 0

    @property
    def ratio(self) -> float:
        return self.out_ratio if self.out_ratio is not None else (0.0 if self.decoder else 1.0)


@dataclass
class ScenarioFile:
    """A parsed scenario file.

    Args:
        path: the file.
        label: the name printed in reports.
        gpu: the analytical GPU preset.
        global_batch: samples per step.
        gpus: the default GPU budget.
        seed: seed of the synthetic batch.
        modalities: modality -> share of the samples.
        sections: the sections, producers before consumers.
    """

    path: Path
    label: str
    gpu: GPUPreset
    global_batch: int
    gpus: int
    seed: int
    modalities: dict[str, float]
    sections: list[SectionEntry]


def is_scenario_file(data: dict) -> bool:
    """``data`` (a TOML file's tables) is a scenario file of this format: a ``[scenario]``
    table and ``[sections.NAME]`` tables (a run config has no ``[scenario]``; a built-in
    scenario's file no ``[sections]``)."""
    return isinstance(data.get("scenario"), dict) and "sections" in data


def _where(path: Path, table: str, key: str = "") -> str:
    return f"{path}: [{table}]" + (f" {key}" if key else "")


def _int(path, table, key, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v) or v < lo:
        raise ValueError(f"{_where(path, table, key)}: must be an integer >= {lo}, got {v!r}")
    return int(v)


def _num(path, table, key, v, lo: float = 0.0, strict: bool = False) -> float:
    bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
    if bad or v < lo or (strict and v == lo):
        rel = ">" if strict else ">="
        raise ValueError(f"{_where(path, table, key)}: must be a number {rel} {lo}, got {v!r}")
    return float(v)


def _unknown(path, table: str, got: dict, known) -> None:
    for k in got:
        if k not in known:
            raise ValueError(
                f"{_where(path, table, k)}: unknown key; known keys: {', '.join(sorted(known))}"
            )


def load(path: str | Path) -> ScenarioFile:
    """Read and validate a scenario file (``ValueError`` in one line naming file, table and
    key for every mistake, ``FileNotFoundError`` when ``path`` is missing)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"scenario file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    _unknown(path, "top level", data, {"scenario", "sections", "modalities"})
    head = data.get("scenario")
    if not isinstance(head, dict):
        raise ValueError(f"{path}: no [scenario] table")
    if "name" in head:
        raise ValueError(
            f"{_where(path, 'scenario', 'name')}: names a built-in scenario, which takes no "
            "[sections.NAME] tables; a file describing its own sections gives label instead"
        )
    _unknown(path, "scenario", head, SCENARIO_KEYS)
    for k in ("hardware", "global_batch"):
        if k not in head:
            raise ValueError(f"{_where(path, 'scenario', k)}: required ({SCENARIO_KEYS[k]})")
    if not isinstance(head["hardware"], str):
        raise ValueError(f"{_where(path, 'scenario', 'hardware')}: must be a preset name")
    try:
        gpu = preset(head["hardware"])
    except ValueError as e:
        raise ValueError(f"{_where(path, 'scenario', 'hardware')}: {e}") from None
    batch = _int(path, "scenario", "global_batch", head["global_batch"])
    gpus = _int(path, "scenario", "gpus", head.get("gpus", 8))
    seed = _int(path, "scenario", "seed", head.get("seed", 0), lo=0)
    label = head.get("label", path.stem)
    if not isinstance(label, str):
        raise ValueError(f"{_where(path, 'scenario', 'label')}: must be a string")

    mods = data.get("modalities", {})
    if not isinstance(mods, dict):
        raise ValueError(f"{path}: [modalities] must be a table of shares")
    shares = {}
    for k, v in mods.items():
        shares[k] = _num(path, "modalities", k, v)
        if shares[k] > 1:
            raise ValueError(f"{_where(path, 'modalities', k)}: share must be in [0, 1], got {v}")
    if sum(shares.values()) > 1 + 1e-9:
        raise ValueError(
            f"{path}: [modalities]: shares sum to {sum(shares.values()):g} > 1 (each sample "
            "has at most one modality; the rest have none)"
        )

    secs = data["sections"]
    if not isinstance(secs, dict) or not secs:
        raise ValueError(f"{path}: [sections] must hold at least one [sections.NAME] table")
    entries = {}
    for name, tab in secs.items():
        if not isinstance(tab, dict):
            raise ValueError(f"{path}: sections.{name} must be a table")
        entries[name] = _section(path, name, tab, shares)
    order = _topo(path, entries)
    for e in entries.values():
        if e.tokens.same_as and e.tokens.same_as not in entries:
            raise ValueError(
                f"{_where(path, 'sections.' + e.name, 'tokens')}: {e.tokens.same_as!r} is "
                f"neither a number, a distribution nor a section ({', '.join(entries)})"
            )
    sf = ScenarioFile(path, label, gpu, batch, gpus, seed, shares, [entries[n] for n in order])
    _check_activation(sf)
    return sf


def _section(path: Path, name: str, tab: dict, shares: dict[str, float]) -> SectionEntry:
    t = f"sections.{name}"
    _unknown(path, t, tab, SECTION_KEYS)
    if "model" not in tab:
        raise ValueError(f"{_where(path, t, 'model')}: required ({SECTION_KEYS['model']})")
    model = _model(path, t, tab["model"])
    frozen = tab.get("frozen", False)
    if not isinstance(frozen, bool):
        raise ValueError(f"{_where(path, t, 'frozen')}: must be true or false, got {frozen!r}")
    inputs = tab.get("inputs", [])
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
        raise ValueError(f"{_where(path, t, 'inputs')}: must be a list of section names")
    if name in inputs:
        raise ValueError(f"{_where(path, t, 'inputs')}: a section cannot read itself")
    runs = tab.get("runs_on", "all")
    if isinstance(runs, str):
        runs = [runs]
    if not isinstance(runs, list) or not runs or not all(isinstance(x, str) for x in runs):
        raise ValueError(f"{_where(path, t, 'runs_on')}: must be a modality, a list or 'all'")
    if "all" in runs:
        runs_on = None
    else:
        for m in runs:
            if m not in shares:
                known = ", ".join(shares) or "none: add a [modalities] table"
                raise ValueError(
                    f"{_where(path, t, 'runs_on')}: unknown modality {m!r} (known: {known})"
                )
        runs_on = tuple(runs)
    if ("tokens" in tab) == ("tokens_from" in tab):
        raise ValueError(f"{_where(path, t, 'tokens')}: give exactly one of tokens or tokens_from")
    if "tokens_scale" in tab and "tokens_from" not in tab:
        raise ValueError(f"{_where(path, t, 'tokens_scale')}: scales tokens_from only")
    if "tokens" in tab:
        tokens = _tokens(path, t, tab["tokens"])
    else:
        scale = _num(path, t, "tokens_scale", tab.get("tokens_scale", 1.0), strict=True)
        tokens = _tokens_from(path, t, tab["tokens_from"], scale)
    ratio = tab.get("out_ratio")
    ratio = None if ratio is None else _num(path, t, "out_ratio", ratio)
    obt = tab.get("out_bytes_per_token")
    obt = None if obt is None else _num(path, t, "out_bytes_per_token", obt)
    within = tab.get("attend_within")
    within = None if within is None else _int(path, t, "attend_within", within)
    budget = tab.get("token_budget")
    budget = None if budget is None else _int(path, t, "token_budget", budget)
    tp_plan = tab.get("tp_plan")
    if tp_plan is not None and not isinstance(tp_plan, bool):
        raise ValueError(f"{_where(path, t, 'tp_plan')}: must be true or false, got {tp_plan!r}")
    return SectionEntry(
        name,
        model,
        tokens,
        frozen,
        tuple(dict.fromkeys(inputs)),
        runs_on,
        ratio,
        obt,
        within,
        _int(path, t, "micro_batch_size", tab.get("micro_batch_size", 1)),
        budget,
        tp_plan,
    )


def _model(path: Path, table: str, value) -> ModelSpec:
    where = _where(path, table, "model")
    if not isinstance(value, str):
        raise ValueError(f"{where}: must be a preset name or a config.json path, got {value!r}")
    if value.lower() in PRESETS:
        return PRESETS[value.lower()]
    file = Path(value)
    if not file.is_absolute():
        file = path.parent / file
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{where}: {value!r} is not a preset ({', '.join(PRESETS)}) and {file} does not exist"
        )
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {file} is not valid JSON ({e})") from None
    try:
        return from_hf_config(
            cfg, name=file.parent.name if file.name == "config.json" else file.stem
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {file}: {e}") from None


def _tokens(path: Path, table: str, v) -> TokenSpec:
    if isinstance(v, str):
        return TokenSpec(same_as=v)
    if not isinstance(v, dict):
        return TokenSpec(fixed=_int(path, table, "tokens", v))
    dist = v.get("dist")
    if dist not in _DISTS:
        raise ValueError(
            f"{_where(path, table, 'tokens')}: dist must be one of {', '.join(_DISTS)}, "
            f"got {dist!r}"
        )
    need, opt = _DISTS[dist]
    for k in v:
        if k not in need | opt:
            raise ValueError(
                f"{_where(path, table, 'tokens.' + k)}: unknown parameter of a {dist} "
                f"distribution; known: {', '.join(sorted(need | opt))}"
            )
    for k in need:
        if k not in v:
            raise ValueError(f"{_where(path, table, 'tokens.' + k)}: required for {dist}")
    lo = _int(path, table, "tokens.min", v.get("min", 1))
    hi = _int(path, table, "tokens.max", v["max"])
    if hi < lo:
        raise ValueError(f"{_where(path, table, 'tokens.max')}: {hi} < min {lo}")
    params = {"min": lo, "max": hi}
    if dist == "lognormal":
        if ("mean" in v) == ("median" in v):
            raise ValueError(
                f"{_where(path, table, 'tokens.mean')}: give exactly one of mean or median"
            )
        if "sigma" not in v:
            raise ValueError(f"{_where(path, table, 'tokens.sigma')}: required for lognormal")
        sigma = _num(path, table, "tokens.sigma", v["sigma"])
        if sigma > 5:
            raise ValueError(
                f"{_where(path, table, 'tokens.sigma')}: {sigma} is not a plausible log-scale "
                "spread (expected 0 to 5)"
            )
        key = "mean" if "mean" in v else "median"
        centre = _num(path, table, f"tokens.{key}", v[key], strict=True)
        # mean of a log-normal: exp(mu + sigma^2 / 2)
        mu = math.log(centre) - (sigma * sigma / 2 if key == "mean" else 0.0)
        params.update(mu=mu, sigma=sigma)
    return TokenSpec(dist=dist, params=params)


def _tokens_from(path: Path, table: str, v, scale: float) -> TokenSpec:
    where = _where(path, table, "tokens_from")
    if not isinstance(v, str) or ":" not in v:
        raise ValueError(f'{where}: must be "FILE.jsonl:FIELD", got {v!r}')
    name, fld = v.rsplit(":", 1)
    if not fld:
        raise ValueError(f'{where}: no FIELD after the colon in "{v}"')
    file = Path(name)
    if not file.is_absolute():
        file = path.parent / file
    if not file.is_file():
        raise ValueError(f"{where}: data file {file} does not exist")
    out: list[int] = []
    index: list[int] = []
    for no, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        index.append(-1)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {file} line {no}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: {file} line {no}: not a JSON object")
        x = row.get(fld)
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, int | float | str | list):
            raise ValueError(
                f"{where}: {file} line {no}: {fld} is a {type(x).__name__}; expected a "
                "number, a string or a list"
            )
        n = len(x) if isinstance(x, str | list) else x
        if not math.isfinite(n) or n < 0:
            raise ValueError(f"{where}: {file} line {no}: {fld} = {x!r} is not a count")
        index[-1] = len(out)
        out.append(max(1, round(n * scale)))
    if not out:
        raise ValueError(f"{where}: no line of {file} has the field {fld!r}")
    return TokenSpec(values=tuple(out), lines=tuple(index), source=str(file.resolve()))


def _topo(path: Path, entries: dict[str, SectionEntry]) -> list[str]:
    for e in entries.values():
        for i in e.inputs:
            if i not in entries:
                raise ValueError(
                    f"{_where(path, 'sections.' + e.name, 'inputs')}: unknown section {i!r} "
                    f"(sections: {', '.join(entries)})"
                )
    # a tokens alias is a dependency too (its counts come first)
    deps = {
        n: list(e.inputs) + ([e.tokens.same_as] if e.tokens.same_as in entries else [])
        for n, e in entries.items()
    }
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cyc = stack[stack.index(n) :] + [n]
            raise ValueError(
                f"{path}: [sections.{n}] inputs: the sections form a cycle "
                f"({' -> '.join(cyc)}; inputs and tokens = 'SECTION' both count)"
            )
        state[n] = 1
        for d in deps[n]:
            visit(d, stack + [n])
        state[n] = 2
        order.append(n)

    for n in entries:
        visit(n, [])
    return order


def _groups(sf: ScenarioFile) -> list[str | None]:
    """Every modality with a share above 0, and ``None`` (no modality) when samples are left."""
    out: list[str | None] = [m for m, s in sf.modalities.items() if s > 0]
    if sum(sf.modalities.values()) < 1 - 1e-9:
        out.append(None)
    return out


def _runs(e: SectionEntry, group: str | None) -> bool:
    return e.runs_on is None or group in e.runs_on


def _check_activation(sf: ScenarioFile) -> None:
    by = {e.name: e for e in sf.sections}
    consumers = {e.name: [c for c in sf.sections if e.name in c.inputs] for e in sf.sections}
    for g in _groups(sf):
        what = f"modality {g!r}" if g else "samples of no modality"
        active = [e for e in sf.sections if _runs(e, g)]
        if not active:
            raise ValueError(
                f"{sf.path}: [modalities]: {what} runs no section (give a section "
                'runs_on = "all" or list it)'
            )
        for e in active:
            cons = consumers[e.name]
            if cons and not any(_runs(c, g) for c in cons):
                raise ValueError(
                    f"{_where(sf.path, 'sections.' + e.name, 'runs_on')}: runs on {what} "
                    f"but none of its consumers ({', '.join(c.name for c in cons)}) does"
                )
            src = e.tokens.same_as
            if src and not _runs(by[src], g):
                raise ValueError(
                    f"{_where(sf.path, 'sections.' + e.name, 'tokens')}: {src!r} does not "
                    f"run on {what}, which {e.name!r} runs on"
                )


def _draw(spec: TokenSpec, rng: random.Random, line: int | None) -> int:
    if spec.fixed is not None:
        return spec.fixed
    if spec.values:
        if line is None:
            return rng.choice(spec.values)
        # the sample's line, or the next one holding the field
        k = line
        while spec.lines[k % len(spec.lines)] < 0:
            k += 1
        return spec.values[spec.lines[k % len(spec.lines)]]
    p = spec.params
    if spec.dist == "uniform":
        return rng.randint(p["min"], p["max"])
    x = rng.lognormvariate(p["mu"], p["sigma"])
    return int(min(p["max"], max(p["min"], round(x))))


def sample_tokens(spec: TokenSpec, n: int, seed: int = 0) -> list[int]:
    """``n`` draws of a token spec (not ``same_as``) with a fixed seed: a distribution's
    samples, a measured file's values sampled with replacement, or ``fixed`` ``n`` times."""
    if spec.same_as:
        raise ValueError("sample_tokens: a tokens alias has no counts of its own")
    rng = random.Random(seed)
    return [_draw(spec, rng, None) for _ in range(n)]


def _chunk_sq(total: int, within: int | None) -> float:
    if not within or total <= within:
        return float(total * total)
    full, rest = divmod(total, within)
    return float(full * within * within + rest * rest)


def build(sf: ScenarioFile, gpus: int | None = None):
    """The scenario file's workload for ``gpus`` GPUs (default: its ``gpus``): a
    ``maestro.sim.scenarios.Scenario`` with the global batch, the section specs (``dp``
    proportional to each section's work, as the built-in scenarios) and the analytical cost
    model."""
    from maestro.sim.scenarios import Scenario, proportional_dp

    n = sf.global_batch
    groups = _groups(sf)
    # exact shares of the batch (largest remainders), in shuffled positions
    want = {g: (sf.modalities[g] if g else 1.0 - sum(sf.modalities.values())) * n for g in groups}
    count = {g: int(w) for g, w in want.items()}
    for g in sorted(groups, key=lambda g: want[g] - count[g], reverse=True)[
        : n - sum(count.values())
    ]:
        count[g] += 1
    assigned = [g for g in groups for _ in range(count[g])]
    random.Random(f"{sf.seed}:modalities").shuffle(assigned)

    # one data-file line per sample, shared by the sections reading that file
    lines: dict[str, list[int]] = {}
    for e in sf.sections:
        src = e.tokens.source
        if src and src not in lines:
            r = random.Random(f"{sf.seed}:data:{Path(src).name}")  # (not where it lives)
            lines[src] = [r.randrange(len(e.tokens.lines)) for _ in range(n)]

    by = {e.name: e for e in sf.sections}
    pos: dict[str, list[int]] = {}  # positions per sample, 0 where the section does not run
    for e in sf.sections:  # producers first
        rng = random.Random(f"{sf.seed}:{e.name}")
        col = []
        for i, g in enumerate(assigned):
            if not _runs(e, g):
                col.append(0)
                continue
            if e.tokens.same_as:
                own = pos[e.tokens.same_as][i]
            else:
                line = lines[e.tokens.source][i] if e.tokens.source else None
                own = _draw(e.tokens, rng, line)
            extra = sum(round(by[p].ratio * pos[p][i]) for p in e.inputs if pos[p][i] > 0)
            col.append(own + extra)
        pos[e.name] = col

    decoders = [e for e in sf.sections if e.decoder]
    owner = decoders[-1] if decoders else None
    shared = set()
    if owner is not None:
        for e in decoders:
            # (only the samples it runs on count: its micro-batches sum nothing else)
            same = all(pos[owner.name][i] == pos[e.name][i] for i in range(n) if pos[e.name][i])
            if same:
                shared.add(e.name)
    sink = owner.name if owner else sf.sections[-1].name

    samples = []
    for i in range(n):
        active = frozenset(e.name for e in sf.sections if pos[e.name][i] > 0)
        cost: dict[str, float] = {"tokens": float(pos[sink][i])}
        for e in sf.sections:
            if e.name in shared or pos[e.name][i] == 0:
                continue
            cost[f"{e.name}:tokens"] = float(pos[e.name][i])
            cost[f"{e.name}:sq"] = _chunk_sq(pos[e.name][i], e.attend_within)
        samples.append(SampleInfo(i, active, cost))

    consumers = {e.name: [c for c in sf.sections if e.name in c.inputs] for e in sf.sections}
    shapes = {}
    specs = []
    for e in sf.sections:
        m = e.model
        if e.out_bytes_per_token is not None:
            out_bytes = e.out_bytes_per_token
        elif e.ratio > 0:
            width = max((c.model.hidden for c in consumers[e.name]), default=m.hidden)
            out_bytes = e.ratio * width * 2.0
        else:
            out_bytes = 2.0 * m.hidden
        own_key = e.name not in shared
        shapes[e.name] = SectionShape(
            layers=m.layers,
            hidden=m.hidden,
            ffn_hidden=m.ffn,
            vocab=m.vocab,
            unit=f"{e.name}:tokens" if own_key else "tokens",
            out_bytes_per_unit=out_bytes,
            tp_plan=e.tp_plan if e.tp_plan is not None else e.decoder,
            heads=m.heads,
            kv_heads=m.kv_heads,
            gated=m.gated,
            sq_key=f"{e.name}:sq" if own_key else "",
        )
        specs.append(
            SectionSpec(
                e.name,
                inputs=e.inputs,
                dp=1,
                micro_batch_size=e.micro_batch_size,
                frozen=e.frozen,
                token_budget=e.token_budget,
            )
        )
    cm = AnalyticalCostModel(shapes, gpu=sf.gpu)
    g = max(gpus if gpus is not None else sf.gpus, len(specs))
    return Scenario(sf.label, samples, proportional_dp(samples, specs, cm, g), cm)


__all__ = [
    "PRESETS",
    "SCENARIO_KEYS",
    "SECTION_KEYS",
    "ScenarioFile",
    "SectionEntry",
    "TokenSpec",
    "build",
    "is_scenario_file",
    "load",
    "sample_tokens",
]
