"""Issue 31 item 4: every failure of ``maestro train`` is a clear message (real processes).

A user's job (a module next to the TOML: an embedding section feeding a trainable sink) fails
in the ways a run fails: an exception in the user's forward, a sink returning no loss, a
config error found on one rank only, a rank killed or exiting, and SIGTERM/SIGINT/SIGKILL sent
to the launcher alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from maestro.runtime import checkpoint as ck
from maestro.runtime import failures

BIN = Path(sys.executable).parent

JOB = textwrap.dedent(
    """
    import os

    import torch
    from torch import nn

    from maestro import Job, Section

    MODE = os.environ.get("USERJOB_MODE", "")


    class Emb(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)

        def forward(self, ids):
            return self.emb(ids)


    class Head(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.out = nn.Linear(dim, vocab)

        def forward(self, h):
            return self.out(torch.tanh(h))


    def encode(module, samples, inputs):
        if MODE == "encvalue" or (MODE == "metaonly" and module.emb.weight.is_meta):
            parse_width("wide")
        if MODE == "probes" and module.emb.weight.is_meta:  # the cost model's FLOP count
            with open("probes.txt", "a") as f:
                f.write(f"{os.getpid()} ")
        if MODE == "few":  # one output short
            samples = samples[:-1]
        return [{"h": module(s["input_ids"])} for s in samples]


    def parse_width(text):
        return int(text)


    def learn(module, samples, inputs):
        outs = []
        for s, e in zip(samples, inputs["enc"]):
            logits = module(e["h"][:-1])
            if MODE == "value":
                parse_width("wide")
            if MODE == "exit":
                os._exit(3)
            if MODE == "vector":  # per-token losses instead of their sum
                loss = nn.functional.cross_entropy(logits, s["input_ids"][1:], reduction="none")
            else:
                loss = nn.functional.cross_entropy(logits, s["input_ids"][1:], reduction="sum")
            outs.append({"logits": logits} if MODE == "noloss" else {"loss": loss})
        return outs


    def job(config):
        w = config.model
        g = torch.Generator().manual_seed(0)
        records = []
        for _ in range(32):
            n = int(torch.randint(3, 9, (1,), generator=g))
            records.append({"input_ids": torch.randint(0, w["vocab"], (n,), generator=g).tolist()})
        if MODE == "oov":  # one token beyond the vocabulary
            records[7]["input_ids"][1] = w["vocab"] + 3
        if "records" in w:
            records = records[: w["records"]]
        return Job(
            [
                Section("enc", lambda: Emb(w["vocab"], w["dim"]), forward=encode),
                Section("student", lambda: Head(w["vocab"], w["dim"]), inputs=["enc"],
                        forward=learn),
            ],
            dataset=records,
        )
    """
)


def write_run(tmp_path, enc_dp=1, student="", steps=3, global_batch=4, model=""):
    (tmp_path / "userjob.py").write_text(JOB)
    path = tmp_path / "run.toml"
    path.write_text(
        f"""
global_batch = {global_batch}
steps = {steps}
dtype = "float32"
threads = 1
[workload]
name = "userjob:job"
vocab = 16
dim = 8
{model}
[sections.enc]
dp = {enc_dp}
micro_batch_size = 4
[sections.student]
dp = 1
micro_batch_size = 2
{student}
"""
    )
    return path


def _load_in_process(monkeypatch, tmp_path, fn):
    """``fn()`` with this test's ``userjob`` module importable, leaving no ``userjob`` in
    ``sys.modules`` for other tests (theirs has the same name)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = sys.modules.pop("userjob", None)
    try:
        return fn()
    finally:
        sys.modules.pop("userjob", None)
        if saved is not None:
            sys.modules["userjob"] = saved


def _env(**kw):
    return {**os.environ, "OMP_NUM_THREADS": "1", **kw}


def train(path, *args, env=None):
    cmd = [str(BIN / "maestro"), "train", str(path), "--device", "cpu", "--quiet", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=env or _env(), cwd=path.parent
    )


def test_error_in_user_forward_shows_the_users_frames(tmp_path):
    path = write_run(tmp_path)
    r = train(path, env=_env(USERJOB_MODE="value"))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert (
        "maestro train: error: rank 1 (student[0]) at step 0: ValueError: invalid literal for "
        "int() with base 10: 'wide'" in lines
    ), r.stderr
    job = str(tmp_path / "userjob.py")
    at = {ln.strip(): n for n, ln in enumerate(JOB.splitlines(), start=1)}
    call, ret = at['parse_width("wide")'], at["return int(text)"]
    assert f'  File "{job}", line {call}, in learn' in lines
    assert f'  File "{job}", line {ret}, in parse_width' in lines
    assert "maestro/runtime" not in r.stderr and "Traceback" not in r.stderr
    # the user's error comes first and alone: no resume hint after a bug in their code
    assert lines[0].startswith("maestro train: error: rank 1"), r.stderr
    assert "resume" not in r.stderr and "checkpoint" not in r.stderr
    # --debug: the full traceback, maestro's frames included
    r = train(path, "--debug", env=_env(USERJOB_MODE="value"))
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr
    assert "maestro/runtime/executor.py" in r.stderr
    assert f'File "{job}", line {ret}' in r.stderr


def test_the_users_error_comes_first_and_alone(tmp_path):
    """The meta-device cost probe fails on the same forward (its note used to come first,
    from the failing rank itself: rank 0) and no resume hint follows a bug in the code."""
    path = write_run(tmp_path)
    args = ["--scheduler", "wavefront", "--checkpoint-every", "1", "--checkpoint-dir", "ck"]
    r = train(path, *args, env=_env(USERJOB_MODE="encvalue"))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == (
        "maestro train: error: rank 0 (enc[0]) at step 0: ValueError: invalid literal for "
        "int() with base 10: 'wide'"
    ), r.stderr
    assert lines[1].startswith("your code"), r.stderr
    assert all(ln.startswith("  ") for ln in lines[2:]), r.stderr  # the user's frames only
    # a run that works still gets the note, after its first step
    r = train(path, "--scheduler", "wavefront", "--steps", "1", env=_env(USERJOB_MODE="metaonly"))
    assert r.returncode == 0, r.stderr
    assert "cost estimate: FLOPs of enc (ValueError)" in r.stderr, r.stderr


def test_sink_without_loss_names_the_section_in_one_line(tmp_path):
    path = write_run(tmp_path)
    r = train(path, env=_env(USERJOB_MODE="noloss"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "maestro train: error: section 'student' is a sink: its forward must return a "
        "\"loss\" per sample; got keys ['logits']"
    )
    assert "Traceback" not in r.stderr and "KeyError" not in r.stderr


@pytest.mark.parametrize(
    "mode, want",
    [
        (
            "vector",
            "section 'student', sample 0 of step 0 (dataset record {rec}): its forward must "
            'return one "loss" number per sample (e.g. summed over the sample\'s tokens); got a '
            "tensor of shape ({n},)",
        ),
        (
            "few",
            "section 'enc', sample 3 of step 0 (dataset record {rec}): its forward returned 3 "
            "output(s) for a micro-batch of 4 samples; expected a list of one dict per sample, "
            "in the samples' order",
        ),
        (
            "oov",
            "section 'enc', sample {sid} of step {step} (dataset record 7): token id 19 in "
            "'input_ids' is outside the section's embedding of 16 rows (expected ids in [0, 16); "
            "was the data made with another vocabulary or tokenizer?)",
        ),
    ],
)
def test_a_samples_mistake_names_section_sample_and_expectation(tmp_path, monkeypatch, mode, want):
    """Issue 44 item 4: a per-token loss vector, a forward one output short, a token outside
    the vocabulary: one line each (not torch's stack/index errors, not an assertion)."""

    from maestro import config as C

    path = write_run(tmp_path, steps=8)
    r = train(path, "--scheduler", "fifo", env=_env(USERJOB_MODE=mode))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    # where the sample came from: the job's own order (the same on every rank)
    monkeypatch.setenv("USERJOB_MODE", mode)
    job = _load_in_process(monkeypatch, tmp_path, lambda: C.load(path).job())
    if mode == "oov":
        step, sid = next((s, job.indices(s).index(7)) for s in range(8) if 7 in job.indices(s))
        want = want.format(sid=sid, step=step)
    else:
        rec = job.indices(0)[0 if mode == "vector" else 3]
        n = len(job.dataset[rec]["input_ids"]) - 1
        want = want.format(rec=rec, n=n)
    assert lines[0] == f"maestro train: error: {want}"


def test_global_batch_below_dp_is_refused(tmp_path):
    path = write_run(tmp_path, enc_dp=2, global_batch=1)
    r = train(path, "--nproc", "3")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "maestro train: error: global_batch = 1 is smaller than sections.enc's 2 data-parallel "
        "replicas (dp x fsdp): a replica would get no sample; set global_batch >= 2 or lower dp"
    ]


def test_dataset_smaller_than_a_step_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    from maestro import config as C
    from maestro.runtime.launch import RunOptions, launch

    path = write_run(tmp_path, global_batch=8, model="records = 3")
    want = (
        "global_batch: the dataset has 3 records but global_batch = 8, so one step would read "
        "some records twice; lower global_batch to at most 3 or add records"
    )
    r = train(path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"maestro train: error: {want}"]

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(mp, "start_processes", no_ranks)
    with pytest.raises(ValueError) as e:
        opts = RunOptions(device="cpu", progress=False)
        _load_in_process(monkeypatch, tmp_path, lambda: launch(C.load(path), opts=opts))
    assert str(e.value) == want


def test_config_error_on_one_rank_beats_the_peers_lost_connections(tmp_path):
    """enc on ranks 0-1, student (recompute without a transformer block) on rank 2 alone; the
    failing rank exits 3 s late (test hook) so the launcher first sees rank 0's gloo error."""
    path = write_run(tmp_path, enc_dp=2, student="recompute = true")
    r = train(path, "--nproc", "3", env=_env(MAESTRO_FAULT_LINGER_S="3"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("maestro train: error: sections.student.recompute: ")
    assert "no block" in lines[0]


@pytest.mark.parametrize("how", ["killed", "exit"])
def test_dead_rank_is_one_line_with_the_resume_hint(tmp_path, how):
    path = write_run(tmp_path)
    if how == "killed":  # rank 1 (student) SIGKILLs itself mid-step 1
        env = _env(MAESTRO_FAULT_KILL_AT_STEP="1")
        args = ["--checkpoint-every", "1", "--checkpoint-dir", "ck"]
        want = (
            "maestro train: error: rank 1 (student[0]) was killed by SIGKILL at step 1; "
            f"resume with: maestro train {path} --device cpu --quiet --checkpoint-every 1 "
            "--checkpoint-dir ck --resume"
        )
    else:  # the user's forward calls os._exit(3): no Python exception
        env, args = _env(USERJOB_MODE="exit"), []
        want = (
            "maestro train: error: rank 1 (student[0]) exited with code 3 at step 0; no "
            "checkpoint to resume from (--checkpoint-every K --checkpoint-dir D makes a run "
            "resumable)"
        )
    r = train(path, *args, env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [want]


def _running(procs):
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _start_long_run(tmp_path, quiet=True):
    path = write_run(tmp_path, steps=100000)
    err = open(tmp_path / "stderr.txt", "w")
    cmd = [str(BIN / "maestro"), "train", str(path), "--device", "cpu"] + ["--quiet"] * quiet
    cmd += ["--checkpoint-every", "5", "--checkpoint-dir", "ck"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=_env(), cwd=tmp_path)
    deadline = time.time() + 60
    while ck.latest(tmp_path / "ck") is None:  # training has started: a checkpoint is written
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        assert time.time() < deadline, "no checkpoint within 60 s"
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2  # the ranks (and the fork server, the resource tracker)
    return path, proc, children, err


def _stopped_cleanly(tmp_path, proc, children, err, sig, t0: float | None = None) -> str:
    """Wait for the launcher to exit; assert it took under 8 s from ``t0`` (when given), that
    no rank, fork server or resource tracker outlives it, that it exited 128 + ``sig`` and
    printed one stop line and no traceback; return that line."""
    try:
        proc.wait(timeout=8)
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    took = None if t0 is None else time.time() - t0
    _, alive = psutil.wait_procs(_running(children), timeout=3)
    assert not _running(alive), [p.cmdline()[:3] for p in _running(alive)]
    assert took is None or took < 8
    assert proc.returncode == 128 + sig
    out = (tmp_path / "stderr.txt").read_text().splitlines()
    line = [ln for ln in out if ln.startswith("maestro train: stopped")]
    assert len(line) == 1, out[-5:]
    assert line[0].startswith(f"maestro train: stopped by {sig.name} at step ")
    assert "Traceback" not in "\n".join(out)
    return line[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_rank(tmp_path, sig):
    path, proc, children, err = _start_long_run(tmp_path)
    t0 = time.time()
    proc.send_signal(sig)
    line = _stopped_cleanly(tmp_path, proc, children, err, sig, t0)
    assert line.endswith(
        f"; resume with: maestro train {path} --device cpu --quiet --checkpoint-every 5 "
        "--checkpoint-dir ck --resume"
    )


def test_the_stop_handler_raises_once_then_ignores_both_signals():
    """In-process: the first SIGTERM/SIGINT raises ``Stopped``; any later one, while the
    launcher stops its ranks, is ignored; the caller's handlers come back afterwards."""
    from maestro.runtime.launch import _stop_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(failures.Stopped) as stopped:
        with _stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted by the handler at once
    assert stopped.value.signum == signal.SIGTERM
    # still stopping: both ignored until the caller takes its handlers back
    for sig in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(sig) == signal.SIG_IGN
        os.kill(os.getpid(), sig)
        time.sleep(0.01)  # a handler, were one left, would run here
    stopped.value.restore_signals()
    assert {s: signal.getsignal(s) for s in before} == before
    with pytest.raises(failures.Stopped) as stopped:
        with _stop_on_signals():
            with pytest.raises(failures.Stopped):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):  # while "stopping"
                os.kill(os.getpid(), sig)
                time.sleep(0.01)
            raise failures.Stopped(signal.SIGINT)
    stopped.value.restore_signals()
    assert {s: signal.getsignal(s) for s in before} == before
    with _stop_on_signals():  # no stop: handlers back on leaving
        pass
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_signal_while_stopping_is_ignored(tmp_path):
    """SIGTERM, then SIGINT again and again while the ranks are being stopped: the first
    signal decides (exit 128 + SIGTERM, one stop line), the later ones are ignored, and no
    rank, fork server or resource tracker outlives the launcher."""
    _, proc, children, err = _start_long_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    # the first signal has been handled once the launcher has begun stopping its ranks
    deadline = time.time() + 5
    while len(_running(children)) == len(children) and time.time() < deadline:
        time.sleep(0.002)
    while proc.poll() is None and time.time() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.01)
    _stopped_cleanly(tmp_path, proc, children, err, signal.SIGTERM)


def test_launcher_killed_outright_takes_its_ranks_along(tmp_path):
    _, proc, children, err = _start_long_run(tmp_path)
    proc.kill()
    proc.wait(timeout=5)
    err.close()
    _, alive = psutil.wait_procs(_running(children), timeout=5)
    assert not _running(alive), [p.cmdline()[:3] for p in _running(alive)]


def test_pick_prefers_a_real_error_over_lost_connections():
    lost = failures.Failure("secondary", "RuntimeError", "Connection closed by peer", time=1.0)
    real = failures.Failure("config", "ValueError", "sections.x.tp must divide", time=2.0)
    died = failures.death(1, -9, {"step": 4, "section": "student[0]"})
    assert failures.pick([lost, real], died) is real
    assert failures.pick([lost], died) is died
    assert failures.pick([lost]) is lost
    assert failures.summary(died) == "rank 1 (student[0]) was killed by SIGKILL at step 4"
    try:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    except RuntimeError as e:
        assert failures.classify(e).kind == "secondary"
    try:
        int("x")  # raised in this (the user's) file
    except ValueError as e:
        f = failures.classify(e)
        assert f.kind == "user" and "test_train_failures.py" in f.user_tb


def test_launcher_line_ends_a_log_redirected_to_a_file(tmp_path):
    """``2> log``: the ranks append to the file; the launcher's own handle (opened by the
    shell without O_APPEND) must write its final line at the end, not over the beginning."""
    path = write_run(tmp_path)
    log = tmp_path / "log"
    head = "start of the user's log\n"
    with open(log, "w") as f:  # the shell's `2> log`: offset after what is already there
        f.write(head)
        f.flush()
        # not --quiet: the ranks' progress lines grow the file past the launcher's offset
        cmd = [str(BIN / "maestro"), "train", str(path), "--device", "cpu"]
        env = _env(MAESTRO_FAULT_KILL_AT_STEP="2")
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=f, timeout=120, env=env)
    assert r.returncode == 1
    text = log.read_text()
    assert text.startswith(head), text
    # the launcher's line comes after the ranks' progress bar instead of over the head
    bar = text.find("step/s]")
    line = text.find("maestro train: error: rank 1 (student[0]) was killed")
    assert 0 <= bar < line, text


def test_no_leaked_semaphore_warning_on_any_stop_path(tmp_path):
    """Issue 44 item 5: rank 0's progress bar (tqdm's default lock is a multiprocessing
    semaphore) made the resource tracker warn of a leaked semaphore whenever rank 0 was
    stopped by a signal: SIGTERM or SIGINT to the launcher, or a killed rank."""
    # a killed rank (not --quiet: the bar is on); through a pipe, so every writer of stderr,
    # the resource tracker included, has exited when the run returns
    path = write_run(tmp_path)
    cmd = [str(BIN / "maestro"), "train", str(path), "--device", "cpu"]
    env = _env(MAESTRO_FAULT_KILL_AT_STEP="2")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert "leaked semaphore" not in r.stderr and "resource_tracker" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("maestro train: error: rank 1")
    # SIGTERM and SIGINT to the launcher: its stop path waits for the resource tracker
    for sig in (signal.SIGTERM, signal.SIGINT):
        run_dir = tmp_path / sig.name
        run_dir.mkdir()
        _, proc, children, err = _start_long_run(run_dir, quiet=False)
        proc.send_signal(sig)
        _stopped_cleanly(run_dir, proc, children, err, sig)
        text = (run_dir / "stderr.txt").read_text()
        assert "leaked semaphore" not in text and "resource_tracker" not in text, text[-2000:]


def test_start_up_speaks_a_line_per_phase(tmp_path):
    """Issue 44 item 3: what the launcher does (sections, ranks, layout), then a line per phase
    with its elapsed time, in order, before the first step's progress."""
    import re

    path = write_run(tmp_path, enc_dp=2)
    cmd = [str(BIN / "maestro"), "train", str(path), "--device", "cpu", "--nproc", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [
        ln for ln in r.stderr.replace("\r", "\n").splitlines() if ln.startswith("maestro train")
    ]
    t = r"\[\d+\.\d s\]"
    want = [
        rf"maestro train: loading {re.escape(str(path))}$",
        r"maestro train: enc dp 2 \(ranks 0-1\); student dp 1 \(rank 2\); 3 ranks, gloo "
        rf"on cpu; starting the ranks {t}$",
        rf"maestro train: 3 ranks started {t}$",
        rf"maestro train: models built {t}$",
        rf"maestro train: first step done \(loss \d+\.\d{{4}}\) {t}$",
    ]
    assert len(lines) == len(want), r.stderr
    for line, pattern in zip(lines, want):
        assert re.match(pattern, line), (line, pattern)
    # --quiet: none of them
    r = train(path, "--nproc", "3")
    assert r.returncode == 0 and "maestro train" not in r.stderr, r.stderr


def test_dead_rank_under_torchrun_is_one_line_from_the_survivor(tmp_path):
    """Issue 44 item 5: rank 1 SIGKILLs itself under torchrun; rank 0, which loses its peer,
    prints one line (not gloo's traceback, which torch prefixes with ``[rank0]:``)."""
    import re

    path = write_run(tmp_path)
    # torchrun's agent SIGTERMs the survivor once it sees a rank die (it looks every
    # --monitor-interval s, 0.1 by default): a slow survivor could be stopped before it read
    # the closed connection, and say nothing; 10 s gives it time on a loaded machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "--monitor-interval", "10"]
    cmd += ["-m", "maestro.train", str(path), "--device", "cpu", "--quiet"]
    env = _env(MAESTRO_FAULT_KILL_AT_STEP="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode != 0
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("maestro.train:")]
    assert len(ours) == 1, r.stderr
    assert re.match(
        r"maestro\.train: error: rank 0 \(enc\[0\]\) at step \d+ lost its connection to another "
        r"rank, which failed or was killed \(that rank's own output, or torchrun's summary, "
        r"says why\): RuntimeError: .*Connection closed by peer",
        ours[0],
    ), ours[0]
    assert not [ln for ln in r.stderr.splitlines() if ln.startswith("[rank0]")], r.stderr


def test_one_rank_counts_the_flops_for_all(tmp_path):
    """The scheduler's FLOP estimate is counted on rank 0 and broadcast (it was counted by
    every rank: the same model at a rank's CPU time each, before the first step)."""
    path = write_run(tmp_path, enc_dp=2)
    r = train(path, "--nproc", "3", "--scheduler", "wavefront", env=_env(USERJOB_MODE="probes"))
    assert r.returncode == 0, r.stderr
    pids = set((tmp_path / "probes.txt").read_text().split())
    assert len(pids) == 1, pids
