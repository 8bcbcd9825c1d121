"""Build hooks of the documentation site (``mkdocs.yml``, ``hooks:``): references generated
from the code, and the repository's top-level documents carried into the site.

Generated at every build, so they cannot drift from the code:

- ``reference/config.md``: every field of the run config (``maestro.config``: top level,
  ``[workload]`` of each shipped job, ``[sections.NAME]``, ``[eval]``), of scenario files
  (``[scenario]``) and of Quiver's ``ServeConfig``: type, default and meaning, read from the
  dataclasses (types, defaults) and their field docstrings (the string under each field; the
  ``Args:`` section for ``ServeConfig``). A field without a docstring is a build warning, so
  ``mkdocs build --strict`` fails on it.
- ``reference/cli.md``: every ``quiver`` and ``maestro`` sub-command, walked from the argparse
  parsers the console scripts build (``quiver.cli.build_parser``, ``maestro.cli.build_parser``).
- The endpoint reference of ``quiver/http-api.md`` (the page's ``<!-- generated: openapi -->``
  line): rendered from ``app.openapi()`` of the server's FastAPI app
  (``quiver.serving.app.create_app``), built on a stand-in engine.

The generators are plain functions (``config_reference()``, ``cli_reference()``,
``openapi_reference()``), so ``tests/test_docs.py`` calls them without MkDocs installed.

Top-level documents (``CHANGELOG.md``, ``BENCHMARKS.md``, ``RELIABILITY.md``) stay at the
repository root, where a clone shows them; the site carries a copy of each at the docs root.
A page links them by their path in the repository (``../BENCHMARKS.md`` from ``docs/``), so the
link works in a clone, and ``on_page_markdown`` rewrites every link that leaves ``docs/`` to its
place in the site.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src"

log = logging.getLogger("mkdocs.hooks.reference")

#: repository files outside ``docs/`` that the site carries, at this docs-relative path
MIRRORED = {
    "CHANGELOG.md": "CHANGELOG.md",
    "BENCHMARKS.md": "BENCHMARKS.md",
    "RELIABILITY.md": "RELIABILITY.md",
}

#: a page line replaced by generated Markdown at build time -> its generator's name
MARKERS = {"<!-- generated: openapi -->": "openapi_reference"}


def _problem(msg: str) -> None:
    """A build warning (``--strict`` makes it fail the build); tests collect it as well."""
    PROBLEMS.append(msg)
    log.warning(msg)


#: problems found by the last generator run (missing docstrings, unreadable parsers)
PROBLEMS: list[str] = []


# ---------------------------------------------------------------------------------------------
# config reference


def _field_docs(cls: type) -> dict[str, str]:
    """``field -> docstring``: the string literal right under each annotated field of ``cls``
    (attribute docstrings are not kept at runtime, so they are read from the source)."""
    src = inspect.getsource(cls)
    tree = ast.parse(inspect.cleandoc("\n" + src) if src.startswith(" ") else src)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    out: dict[str, str] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def _args_docs(cls: type) -> dict[str, str]:
    """``field -> text`` from the ``Args:`` section of ``cls``'s docstring (Google style)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return {}
    out: dict[str, list[str]] = {}
    name = None
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break
        m = re.match(r"^    (\w+):\s*(.*)$", line)
        if m:
            name = m.group(1)
            out[name] = [m.group(2)]
        elif name is not None and line.strip():
            out[name].append(line.strip())
    return {k: " ".join(v) for k, v in out.items()}


def _toml(value: Any) -> str:
    """A default as it is written in TOML (``None``: unset)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (int, float)):
        return f"`{value!r}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, dict):
        inner = ", ".join(f"{k} = {_toml(v).strip('`')}" for k, v in value.items())
        return f"`{{ {inner} }}`" if inner else "`{}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(_toml(v).strip("`") for v in value) + "]`"
    return f"`{value!r}`"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _toml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _toml(f.default_factory())
    return "required"


def _cell(text: str) -> str:
    """One table cell: a paragraph on one line (pipes outside code spans escaped)."""
    text = " ".join(text.split())
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"`{t}`"


def _fields_table(
    cls: type, *, skip: tuple[str, ...] = (), docs: dict[str, str] | None = None
) -> str:
    """``| key | type | default | meaning |`` for every field of dataclass ``cls``."""
    docs = _field_docs(cls) if docs is None else docs
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        doc = docs.get(f.name)
        if not doc:
            _problem(f"{cls.__module__}.{cls.__qualname__}.{f.name}: field has no docstring")
            doc = "(undocumented)"
        rows.append(f"| `{f.name}` | {_type(f)} | {_default(f)} | {_cell(doc)} |")
    return "\n".join(rows)


def _class_doc(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    return doc.split("\n\nArgs:")[0].strip()


def config_reference() -> str:
    """The run-config reference page (Markdown)."""
    _src_on_path()
    from maestro.config import EvalConfig, KDConfig, MLLMConfig, SectionConfig, TrainConfig
    from maestro.emulate.job import Config as EmulateConfig
    from maestro.hf.scenarios import KDConfig as HFKDConfig
    from maestro.hf.scenarios import MLLMConfig as HFMLLMConfig
    from maestro.plan.workload import ScenarioSpec
    from quiver.serving.config import ServeConfig

    train_docs = _field_docs(TrainConfig)
    tables = ("workload", "model", "sections", "eval")
    out = [
        "# Run-config reference",
        "",
        "<!-- Generated at build time by docs/hooks/reference.py from the dataclasses of "
        "src/maestro/config.py and friends: edit their field docstrings, not this page. -->",
        "",
        "A run config is a TOML file: top-level keys, a `[workload]` table naming the job, one "
        "`[sections.NAME]` table per section and an optional `[eval]` table "
        "([train your own compound model](../maestro/train-your-own.md) walks through one). "
        "`maestro.config.load(path)` reads and validates it; a mistake is a one-line "
        "`ValueError` naming the field. This page is generated from the dataclasses' field "
        "docstrings in `src/maestro/config.py` (and the job configs next to their jobs) at "
        "every build of the site, so it always matches the code.",
        "",
        "## Top-level keys",
        "",
        f"`TrainConfig`: {_cell(_class_doc(TrainConfig))}",
        "",
        _fields_table(TrainConfig, skip=tables, docs=train_docs),
        "",
        "## `[workload]`",
        "",
        f"`name`: {_cell(train_docs.get('workload', ''))}",
        "",
        f"The other keys: {_cell(train_docs.get('model', ''))} The shipped jobs' keys follow.",
        "",
    ]
    jobs = [
        ('name = "kd"', KDConfig),
        ('name = "mllm"', MLLMConfig),
        ('name = "maestro.hf.scenarios:kd"', HFKDConfig),
        ('name = "maestro.hf.scenarios:mllm"', HFMLLMConfig),
        ("emulated runs (`maestro train --emulate`)", EmulateConfig),
    ]
    for title, cls in jobs:
        out += [
            f"### {title if title.startswith('emulated') else '`' + title + '`'}",
            "",
            f"`{cls.__module__}.{cls.__qualname__}`: {_cell(_class_doc(cls))}",
            "",
            _fields_table(cls),
            "",
        ]
    out += [
        "## `[sections.NAME]`",
        "",
        f"{_cell(train_docs.get('sections', ''))} `SectionConfig`: "
        f"{_cell(_class_doc(SectionConfig))}",
        "",
        _fields_table(SectionConfig),
        "",
        "## `[eval]`",
        "",
        f"`EvalConfig`: {_cell(_class_doc(EvalConfig))}",
        "",
        _fields_table(EvalConfig),
        "",
        "## Scenario files: `[scenario]`",
        "",
        "`maestro plan FILE` and `maestro simulate FILE` also read scenario files "
        "(`examples/paper_kd.toml`, `examples/paper_mllm.toml`): one `[scenario]` table, "
        f"`maestro.plan.workload.ScenarioSpec`: {_cell(_class_doc(ScenarioSpec))}",
        "",
        _fields_table(ScenarioSpec),
        "",
        *_scenario_file_reference(),
        "## Quiver: `ServeConfig`",
        "",
        "`quiver.serving.config.ServeConfig` holds the serving engine's settings: `quiver "
        "serve` fills it from its flags ([CLI reference](cli.md#quiver-serve)), and "
        "`Server.from_dataset(..., config=ServeConfig(...))` takes it in Python. "
        f"{_cell(_class_doc(ServeConfig))}",
        "",
        _fields_table(ServeConfig, docs=_args_docs(ServeConfig)),
        "",
    ]
    return "\n".join(out)


def _scenario_file_reference() -> list[str]:
    """The keys of scenario files describing their own sections (``maestro.sim.scenario_file``)."""
    from maestro.sim import scenario_file as sf

    def table(keys: dict[str, str]) -> list[str]:
        return ["| key | meaning |", "|---|---|"] + [
            f"| `{k}` | {_cell(v)} |" for k, v in keys.items()
        ]

    return [
        "## Scenario files of your own sections",
        "",
        "A scenario file with `[sections.NAME]` tables describes the user's own workload "
        "([plan your own workload](../maestro/plan.md#plan-your-own-workload), "
        "`examples/optimus_table10.toml`): `maestro.sim.scenario_file`. Every mistake is a "
        "one-line error naming the file, the table and the key.",
        "",
        "### `[scenario]`",
        "",
        *table(sf.SCENARIO_KEYS),
        "",
        "### `[modalities]`",
        "",
        "Each key a modality, its value the share of the samples that carry it (each in "
        "[0, 1], summing to at most 1; the rest carry none).",
        "",
        "### `[sections.NAME]`",
        "",
        *table(sf.SECTION_KEYS),
        "",
        f"Model presets: {', '.join(f'`{k}`' for k in sf.PRESETS)}.",
        "",
    ]


# ---------------------------------------------------------------------------------------------
# CLI reference


def _subcommands(parser: argparse.ArgumentParser):
    """``(name, help, parser)`` of each sub-command, in ``--help`` order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _option_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    if action.choices is not None and action.metavar is None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        value = action.metavar or action.dest.upper()
    if action.nargs in ("*", "+", "?"):
        value = f"[{value} ...]" if action.nargs != "?" else f"[{value}]"
    return f"`{names} {value}`"


def _action_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0:
        return ""
    return f"`{d}`"


def _parser_section(prog: str, name: str, summary: str, sub: argparse.ArgumentParser) -> str:
    fmt = sub._get_formatter()
    out = [f"### `{prog} {name}`", ""]
    if summary:
        out += [_cell(summary[0].upper() + summary[1:]) + ".", ""]
    if sub.description:
        out += [inspect.cleandoc(sub.description), ""]
    out += ["```text", sub.format_usage().strip(), "```", ""]
    for group in sub._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        ]
        if not actions:
            continue
        title = group.title or ""
        if title in ("options", "optional arguments"):
            title = "Options"
        elif title == "positional arguments":
            title = "Arguments"
        out += [f"**{title[0].upper() + title[1:]}**", ""]
        if group.description:
            out += [_cell(group.description), ""]
        out += ["| option | default | meaning |", "| --- | --- | --- |"]
        for a in actions:
            text = fmt._expand_help(a) if a.help else ""
            if not text:
                _problem(f"{prog} {name}: option {_option_name(a)} has no help text")
            out.append(f"| {_option_name(a)} | {_action_default(a)} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


def cli_reference() -> str:
    """The CLI reference page (Markdown): every sub-command of both console scripts."""
    _src_on_path()
    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines at the terminal's width
    from maestro.cli import build_parser as maestro_parser
    from quiver.cli import build_parser as quiver_parser

    out = [
        "# CLI reference",
        "",
        "<!-- Generated at build time by docs/hooks/reference.py from the argparse parsers of "
        "src/quiver/cli.py and src/maestro/cli.py: edit their help strings, not this page. -->",
        "",
        "Every sub-command of the `quiver` and `maestro` console scripts, with each option's "
        "default and meaning, as `--help` prints them. This page is walked from the parsers "
        "themselves (`quiver.cli.build_parser()`, `maestro.cli.build_parser()`) at every "
        "build of the site. Both scripts answer `--version`; a user mistake ends with one line "
        "on stderr and exit code 2.",
        "",
    ]
    for prog, build, blurb in (
        ("quiver", quiver_parser, "GNN serving."),
        ("maestro", maestro_parser, "Compound-model training, planning and simulation."),
    ):
        parser = build()
        out += [f"## `{prog}`", "", blurb, ""]
        for name, summary, sub in _subcommands(parser):
            out += [_parser_section(prog, name, summary, sub), ""]
            if (prog, name) == ("maestro", "train"):
                out += [
                    "Under `torchrun`, each rank runs `python -m maestro.train CONFIG` with the "
                    "same options (`maestro.train.add_arguments`): it reads torchrun's "
                    "environment and runs as one rank "
                    "([multi-node with torchrun](../maestro/multi-node.md)).",
                    "",
                ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# HTTP API reference (OpenAPI)


def openapi_schema() -> dict:
    """``app.openapi()`` of the server's FastAPI app, built on a stand-in engine (the schema
    depends on the routes and models only, not on a dataset or a model)."""
    _src_on_path()
    from types import SimpleNamespace

    from quiver.serving.app import create_app
    from quiver.serving.config import ServeConfig
    from quiver.serving.metrics import EngineMetrics

    engine = SimpleNamespace(cfg=ServeConfig(), metrics=EngineMetrics())
    return create_app(engine).openapi()


def _schema_type(s: dict, schemas: dict) -> str:
    if "$ref" in s:
        return s["$ref"].rsplit("/", 1)[-1]
    if "enum" in s:
        return " or ".join(f'"{v}"' for v in s["enum"])
    if "anyOf" in s:
        return " or ".join(_schema_type(x, schemas) for x in s["anyOf"])
    t = s.get("type", "any")
    if t == "array":
        return f"array of {_schema_type(s.get('items', {}), schemas)}"
    return t


def _schema_table(name: str, schemas: dict) -> list[str]:
    s = schemas[name]
    out = [f"`{name}`: {_cell(s.get('description', ''))}", ""]
    props = s.get("properties", {})
    if not props:
        return out
    required = set(s.get("required", []))
    out += ["| field | type | required | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for field, p in props.items():
        default = f"`{json.dumps(p['default'])}`" if "default" in p else ""
        out.append(
            f"| `{field}` | `{_schema_type(p, schemas)}` | {'yes' if field in required else 'no'}"
            f" | {default} | {_cell(p.get('description', ''))} |"
        )
    if s.get("additionalProperties") is False:
        out += ["", "Any other field is refused (422)."]
    return out + [""]


def openapi_reference() -> str:
    """Markdown for every path and method of the server's OpenAPI schema."""
    schema = openapi_schema()
    schemas = schema.get("components", {}).get("schemas", {})
    out = [
        f"Generated from the server's OpenAPI schema ({schema['info']['title']} "
        f"{schema['info']['version']}, OpenAPI {schema['openapi']}); a running server serves "
        "the same document at `GET /openapi.json`.",
        "",
    ]
    shown: set[str] = set()
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            out += [f"### `{method.upper()} {path}`", ""]
            if op.get("description"):
                out += [_cell(op["description"]), ""]
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                ref = _schema_type(content.get("schema", {}), schemas)
                out += [f"Request body (`{media}`):", ""]
                if ref in schemas:
                    out += _schema_table(ref, schemas)
                    shown.add(ref)
            out += ["| status | meaning | body |", "| --- | --- | --- |"]
            for status, resp in op.get("responses", {}).items():
                kinds = resp.get("content", {})
                body_t = ", ".join(
                    f"`{_schema_type(c.get('schema', {}), schemas)}` ({m})"
                    for m, c in kinds.items()
                    if c.get("schema")
                )
                out.append(f"| {status} | {_cell(resp.get('description', ''))} | {body_t} |")
            out.append("")
    rest = [n for n in schemas if n not in shown and not n.endswith("ValidationError")]
    if rest:
        out += ["### Schemas", ""]
        for name in rest:
            out += _schema_table(name, schemas)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# MkDocs hooks

#: docs-relative page path -> generator
GENERATED = {"reference/config.md": config_reference, "reference/cli.md": cli_reference}


def _src_on_path() -> None:
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))


def on_files(files, config):
    """Add the generated references and the mirrored top-level documents to the site."""
    from mkdocs.structure.files import File

    PROBLEMS.clear()
    for uri, generate in GENERATED.items():
        files.append(File.generated(config, uri, content=generate()))
    for name, uri in MIRRORED.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / name)))
    return files


_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _source_path(src_uri: str) -> Path:
    """Where a page's Markdown lies in the repository (mirrored documents at the root)."""
    for name, uri in MIRRORED.items():
        if uri == src_uri:
            return ROOT / name
    return DOCS / src_uri


def rewrite_links(markdown: str, src_uri: str) -> str:
    """Links that leave ``docs/`` (valid in a clone) -> their place in the site."""
    here = _source_path(src_uri).parent
    mirrored = {(ROOT / name).resolve(): uri for name, uri in MIRRORED.items()}

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        path = (here / target).resolve()
        if path in mirrored:
            site_uri = mirrored[path]
        elif DOCS.resolve() in path.parents:
            site_uri = path.relative_to(DOCS.resolve()).as_posix()
        else:
            return m.group(0)  # left as written: MkDocs reports it if it is not in the site
        rel = posixpath.relpath(site_uri, posixpath.dirname(src_uri) or ".")
        return f"{m.group(1)}{rel}{m.group(3)}"

    return _LINK.sub(fix, markdown)


def on_page_markdown(markdown, page, config, files):
    """Fill the generated markers and rewrite links that leave ``docs/``."""
    for marker, name in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, globals()[name]())
    return rewrite_links(markdown, page.file.src_uri)
