"""The documentation cannot rot: its code blocks run, its links resolve, its references cover
the code.

- Every ``bash`` and ``python`` block of ``README.md`` and ``docs/**/*.md`` runs, page by page
  and in order, in a fresh directory holding a copy of ``examples/``, with this environment's
  ``bin/`` first on ``PATH`` (the guides write ``quiver ...``, ``maestro ...``, ``python ...``).
  An HTML comment on the line before a block changes that (``docs/getting-started.md``,
  "Writing these docs"): ``<!-- skip: why -->`` shows it only, ``<!-- file: PATH -->`` writes
  it to ``PATH`` (and a file the repository ships under that path must hold the same text),
  ``<!-- background: URL ... -->`` starts it in the background and waits until every ``URL``
  answers; background blocks are stopped when the page ends. Ports 8000-8009 and 29500-29509
  are replaced by free ones. Pages run two at a time (``DOCS_TEST_JOBS``); python blocks run as
  scripts in children forked from an interpreter that has imported torch and the packages
  (only the import time is shared); a page that starts with the same blocks as another starts
  from a snapshot of that page's directory after them, so the shared "prepare a dataset, train
  a model" runs once.
- Every relative link of ``README.md``, ``CHANGELOG.md`` and ``docs/**/*.md`` points at a file
  a clone has (tracked by git), or, from a docs page, at a page the site generates.
- The generated references (``docs/hooks/reference.py``) name every config field and every CLI
  option, and find no field or option without documentation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)]
RUNNABLE = ("bash", "python")
#: seconds a block may run; a background block's URLs must answer within this too
BLOCK_TIMEOUT = 240
_FENCE = re.compile(r"^```([\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*(skip|file|background)\s*(?::\s*(.*?))?\s*-->\s*$")
_PORT = re.compile(r"\b(800\d|2950\d)\b")


@dataclass
class Block:
    """One fenced code block of a page and the directive on the line before it."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directive: str | None = None  # skip | file | background
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        if self.directive == "skip":
            return False
        return self.directive == "file" or self.lang in RUNNABLE


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, with their directives."""
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(1), []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: unclosed code block"
        block = Block(page, start + 1, lang, "\n".join(body) + "\n")
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        d = _DIRECTIVE.match(lines[prev]) if prev >= 0 else None
        if d:
            block.directive, block.arg = d.group(1), d.group(2) or ""
        out.append(block)
        i += 1
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env.update(
        PATH=bindir + os.pathsep + env.get("PATH", ""),
        HF_HUB_OFFLINE="1",
        MPLBACKEND="Agg",
        PYTHONUNBUFFERED="1",
        TQDM_DISABLE="1",
    )
    env.pop("PYTHONPATH", None)
    return env


def _wait_for(urls: list[str], proc: subprocess.Popen, log: Path, where: str) -> None:
    deadline = time.monotonic() + BLOCK_TIMEOUT
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"{where}: background block exited ({proc.returncode}):\n{_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"{where}: {url} not up within {BLOCK_TIMEOUT} s:\n{_tail(log)}")
            time.sleep(0.5)


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


#: the python-block runner: imports torch and the packages once, then forks a child per
#: block that runs it as ``__main__`` in a fresh namespace (a block is a script, as a user
#: runs it; only the import time is shared). One JSON request per line on stdin, one answer.
_RUNNER = r"""
import json, os, runpy, signal, sys, time, traceback
import numpy, torch, torch_geometric  # noqa: F401
import quiver.datasets, quiver.pyg, quiver.serving.server, quiver.serving.client  # noqa: F401
import maestro.config, maestro.data, maestro.estimate  # noqa: F401
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [req["script"]]
        sys.path[0] = req["cwd"]
        code = 0
        try:
            runpy.run_path(req["script"], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = "timeout"
            break
        time.sleep(0.05)
    print(json.dumps({"rc": rc}), flush=True)
"""


class PythonRunner:
    """Runs python blocks in forked children of one interpreter with the imports done."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        assert self.proc.stdout.readline().strip() == "ready", "python-block runner failed"

    def run(self, script: Path, cwd: Path, env: dict, log: Path, timeout: float):
        req = dict(script=str(script), cwd=str(cwd), env=env, log=str(log), timeout=timeout)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["rc"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _restore(snapshot: Path, work: Path) -> None:
    for p in work.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    shutil.copytree(snapshot, work, dirs_exist_ok=True, symlinks=True)


class Memo:
    """Snapshots of a page's directory after its first blocks, keyed by those blocks' text.

    A page that starts with the same blocks as another (the guides' shared "prepare a dataset,
    train a model") starts from that snapshot instead of running them again; while one page
    runs a prefix, another page that needs it waits for it rather than running it too.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple, list] = {}  # key -> [ready Event, snapshot path or None]

    def claim(self, key: tuple):
        """``(entry, owner)``: the owner runs the blocks and calls ``done``."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = [threading.Event(), None]
                return entry, True
        entry[0].wait()
        return entry, False

    def done(self, entry: list, work: Path | None) -> None:
        if work is not None:
            snapshot = Path(tempfile.mkdtemp(prefix="docs-memo-"))
            shutil.copytree(work, snapshot, dirs_exist_ok=True, symlinks=True)
            entry[1] = snapshot
        entry[0].set()

    def close(self) -> None:
        for _, path in self.entries.values():
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)


def run_page(page: Path, work: Path, runner=None, memo: Memo | None = None) -> None:
    """Run the page's blocks in order in ``work`` (see the module docstring).

    With ``memo``, a page starts from the snapshot of an identical prefix of blocks run
    before (``Memo``). Blocks that name a port, and everything after a background block, are
    not memoised.
    """
    shutil.copytree(
        ROOT / "examples",
        work / "examples",
        ignore=shutil.ignore_patterns("train.jsonl", "heldout.jsonl", "data", "__pycache__"),
    )
    todo = [b for b in blocks(page) if b.runs]
    ports: dict[str, str] = {}
    for b in todo:
        for p in _PORT.findall(b.code + " " + b.arg):
            ports.setdefault(p, str(_free_port()))

    def ported(text: str) -> str:
        return _PORT.sub(lambda m: ports.get(m.group(1), m.group(1)), text)

    env, background, key = _env(), [], ()
    try:
        for n, b in enumerate(todo):
            key += ((b.lang, b.directive, b.arg, b.code),)
            cacheable = (
                memo is not None
                and not background
                and b.directive != "background"
                and not _PORT.search(b.code + b.arg)
            )
            if not cacheable:
                _run_block(n, b, work, env, ported, background, runner)
                continue
            entry, owner = memo.claim(key)
            if not owner and entry[1] is not None:
                _restore(entry[1], work)
                continue
            ok = False
            try:
                _run_block(n, b, work, env, ported, background, runner)
                ok = True
            finally:
                if owner:
                    memo.done(entry, work if ok else None)
    finally:
        for proc in background:
            _stop(proc)


def _run_block(n: int, b: Block, work: Path, env: dict, ported, background: list, runner):
    """Run one block in ``work``; a background one is started and appended to ``background``."""
    times = os.environ.get("DOCS_TEST_TIMES")
    if b.directive == "file":
        shipped = ROOT / b.arg
        if shipped.is_file():
            assert b.code == shipped.read_text(), f"{b.where}: differs from the shipped {b.arg}"
        (work / b.arg).parent.mkdir(parents=True, exist_ok=True)
        (work / b.arg).write_text(b.code)
        return
    code = ported(b.code)
    t0 = time.perf_counter()
    if b.directive == "background":
        log = work / f"_doc_background_{n}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=work,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        background.append(proc)
        _wait_for(ported(b.arg).split(), proc, log, b.where)
        if times:
            print(f"{b.where}: up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return
    if b.lang == "python" and runner is not None:
        script, log = work / f"_doc_block_{n}.py", work / f"_doc_block_{n}.log"
        script.write_text(code)
        rc = runner.run(script, work, env, log, BLOCK_TIMEOUT)
        out = _tail(log)
    else:
        if b.lang == "python":
            (work / f"_doc_block_{n}.py").write_text(code)
            argv = [sys.executable, str(work / f"_doc_block_{n}.py")]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", code]
        try:
            res = subprocess.run(
                argv,
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT,
                start_new_session=True,
            )
            rc, out = res.returncode, f"{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}"
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", f"{e.stdout}\n{e.stderr}"
    if times:
        print(f"{b.where}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    assert rc == 0, f"{b.where}: exit code {rc}\n{code}\n--- output\n{out}"


def _runnable_pages() -> list:
    out = []
    for page in PAGES:
        if any(b.runs and b.directive != "file" for b in blocks(page)):
            rel = page.relative_to(ROOT).as_posix()
            out.append(pytest.param(page, id=rel, marks=pytest.mark.timeout(900)))
    return out


class PageRuns:
    """Runs the selected pages ``DOCS_TEST_JOBS`` at a time (default 2: much of a page's time
    is start-up latency, not CPU), each worker with its own ``PythonRunner``; a page's test
    waits for its own run."""

    def __init__(self, pages: list[Path]) -> None:
        jobs = max(1, int(os.environ.get("DOCS_TEST_JOBS", "2")))
        self.memo, self.local, self.runners = Memo(), threading.local(), []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="docs-page")
        self.dirs = {p: Path(tempfile.mkdtemp(prefix="docs-page-")) for p in pages}
        self.futures = {p: self.pool.submit(self._run, p) for p in pages}

    def _run(self, page: Path) -> None:
        runner = getattr(self.local, "runner", None)
        if runner is None:
            runner = self.local.runner = PythonRunner()
            with self.lock:
                self.runners.append(runner)
        run_page(page, self.dirs[page], runner, self.memo)

    def result(self, page: Path) -> None:
        self.futures[page].result()

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)
        for runner in self.runners:
            runner.close()
        self.memo.close()
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def page_runs(request):
    selected = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_page_code_blocks_run"
    ]
    runs = PageRuns(selected)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("page", _runnable_pages())
def test_page_code_blocks_run(page, page_runs):
    """Every runnable block of the page runs and exits 0, in order."""
    page_runs.result(page)


def test_directives_are_well_formed():
    """Every directive precedes a block it can apply to, and every skip says why."""
    for page in PAGES:
        for b in blocks(page):
            if b.directive == "skip":
                assert b.arg, f"{b.where}: <!-- skip: ... --> must say why"
            if b.directive == "file":
                assert b.arg and not Path(b.arg).is_absolute(), f"{b.where}: file needs a path"
            if b.directive == "background":
                assert b.lang == "bash" and b.arg.startswith("http"), (
                    f"{b.where}: background needs a bash block and the URL(s) to wait for"
                )
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if _DIRECTIVE.match(line):
                nxt = next((x for x in lines[i + 1 :] if x.strip()), "")
                assert _FENCE.match(nxt), (
                    f"{page.relative_to(ROOT)}:{i + 1}: a directive must precede a code block"
                )


# ---------------------------------------------------------------------------------------------
# links


def _hooks():
    path = DOCS / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("docs_reference_hooks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tracked() -> set[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = {ROOT / f for f in out.split("\0") if f}
    return files | {p for f in files for p in f.parents}


def test_relative_links_resolve_in_a_clone():
    """Every relative link of README.md, CHANGELOG.md and the docs points at a file a clone
    has (git-tracked, or not ignored), or, from a docs page, at a page the site generates."""
    generated = {DOCS / uri for uri in _hooks().GENERATED}
    have = _tracked()
    missing = []
    for doc in [ROOT / "README.md", ROOT / "CHANGELOG.md", *PAGES[1:]]:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)  # not in code
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            if path in have or (DOCS in doc.parents and path in generated):
                continue
            missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_every_page_is_in_the_nav():
    """mkdocs.yml's nav lists every page of docs/, the generated ones and the mirrored
    top-level documents, and nothing else (``mkdocs build --strict`` checks it too, where the
    docs extra is installed)."""
    yaml = pytest.importorskip("yaml")

    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for x in node:
                yield from walk(x)
        elif isinstance(node, dict):
            for x in node.values():
                yield from walk(x)

    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = set(walk(cfg["nav"]))
    hooks = _hooks()
    pages = {p.relative_to(DOCS).as_posix() for p in PAGES[1:]}
    expected = pages | set(hooks.GENERATED) | set(hooks.MIRRORED.values())
    assert nav == expected, (sorted(nav - expected), sorted(expected - nav))


# ---------------------------------------------------------------------------------------------
# generated references


def test_config_reference_covers_every_field():
    import dataclasses

    from maestro.config import EvalConfig, KDConfig, MLLMConfig, SectionConfig, TrainConfig

    hooks = _hooks()
    hooks.PROBLEMS.clear()
    text = hooks.config_reference()
    assert not hooks.PROBLEMS, hooks.PROBLEMS
    for cls in (TrainConfig, SectionConfig, EvalConfig, KDConfig, MLLMConfig):
        for f in dataclasses.fields(cls):
            if f.name not in ("workload", "model", "sections", "eval"):
                assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} missing"


def test_cli_reference_covers_every_option():
    from maestro.cli import build_parser as maestro_parser
    from quiver.cli import build_parser as quiver_parser

    hooks = _hooks()
    hooks.PROBLEMS.clear()
    text = hooks.cli_reference()
    assert not hooks.PROBLEMS, hooks.PROBLEMS
    for prog, build in (("quiver", quiver_parser), ("maestro", maestro_parser)):
        for name, _, sub in hooks._subcommands(build()):
            assert f"### `{prog} {name}`" in text
            for action in sub._actions:
                for opt in action.option_strings:
                    if opt not in ("-h", "--help"):
                        assert f"`{opt}" in text or f", {opt}" in text, f"{prog} {name} {opt}"


def test_http_reference_covers_every_route():
    hooks = _hooks()
    schema = hooks.openapi_schema()
    text = hooks.openapi_reference()
    for path, methods in schema["paths"].items():
        for method in methods:
            assert f"### `{method.upper()} {path}`" in text


def test_links_leaving_docs_are_rewritten_for_the_site():
    hooks = _hooks()
    md = "[a](../../BENCHMARKS.md#x) [b](../architecture.md) ![c](../figures/p.png) [d](http://x)"
    assert hooks.rewrite_links(md, "quiver/page.md") == (
        "[a](../BENCHMARKS.md#x) [b](../architecture.md) ![c](../figures/p.png) [d](http://x)"
    )
    assert hooks.rewrite_links("![k](docs/figures/k.png)", "BENCHMARKS.md") == (
        "![k](figures/k.png)"
    )
