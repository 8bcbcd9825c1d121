"""Process launch (local spawn or torchrun's environment) and the per-rank training loop.

``launch(config, nproc)`` spawns ``nproc`` local ranks on 127.0.0.1 and a free port, each
running ``worker_main``; under ``torchrun`` the ranks call ``worker_main`` directly with the
environment torchrun set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``).
Rank 0 returns (and writes, when asked) a result dict: losses, samples/s, busy fractions.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from maestro.config import TrainConfig, from_dict
from maestro.sections import SampleError


@dataclass
class RunOptions:
    """How to run (not what to train).

    Args:
        monolithic: run the DDP-style baseline instead of Maestro's sections.
        trace: path of a Chrome trace to write (rank 0), or ``None``.
        save_dir: directory where each section's final weights are saved as ``NAME.pt``.
        result: path where rank 0 writes the result dict as JSON.
        progress: show a progress bar on rank 0.
        device: ``"auto"`` (CUDA when present, NCCL), ``"cpu"`` (gloo) or ``"cuda"``.
        timeout_s: collective/point-to-point timeout.
        checkpoint_every: write a checkpoint every this many steps (and after the last step);
            0 disables checkpoints.
        checkpoint_dir: where checkpoints and the per-rank sample logs go (shared by all ranks).
        resume: continue from the newest complete checkpoint in ``checkpoint_dir`` (start from
            step 0 when there is none). Under torchrun a restarted attempt
            (``TORCHELASTIC_RESTART_COUNT > 0``) always resumes.
        checkpoint_format: ``"full"`` (each section's replica 0 gathers whole tensors into one
            ``.pt``) or ``"sharded"`` (every rank of a section writes its own shards with
            ``torch.distributed.checkpoint``; ``maestro.parallel.dcp``). Either resumes under
            any layout.
        on_nonfinite: ``"stop"`` (raise, naming the section and step) or ``"skip"`` (every rank
            drops the step's update) when a loss or gradient is NaN/inf.
        log_dir: rank 0 writes TensorBoard event files and ``metrics.jsonl`` here
            (``maestro.runtime.evaluation``); overrides the config's ``log_dir``.
    """

    monolithic: bool = False
    trace: str | None = None
    save_dir: str | None = None
    result: str | None = None
    progress: bool = True
    device: str = "auto"
    timeout_s: float = 300.0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False
    on_nonfinite: str = "stop"
    checkpoint_format: str = "full"
    log_dir: str | None = None

    def validate(self) -> None:
        """``ValueError`` for inconsistent options."""
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir")
        if self.checkpoint_format not in ("full", "sharded"):
            raise ValueError(
                f"--checkpoint-format must be full or sharded, got {self.checkpoint_format!r}"
            )
        if self.checkpoint_format == "sharded" and self.monolithic:
            raise ValueError("--checkpoint-format sharded is for Maestro runs, not --monolithic")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"--on-nonfinite must be stop or skip, got {self.on_nonfinite!r}")


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: when this module was imported: the start-up lines' clock when ``maestro train`` set no
#: ``MAESTRO_T0`` (under torchrun, the Python API)
_T0 = time.time()


def phase(what: str, prog: str = "maestro train") -> None:
    """One start-up line on stderr with the seconds since the launcher started:
    ``maestro train: models built [3.1 s]``."""
    t0 = float(os.environ.get("MAESTRO_T0") or _T0)
    print(f"{prog}: {what} [{time.time() - t0:.1f} s]", file=sys.stderr, flush=True)


def describe_layout(config: TrainConfig, nproc: int, opts: RunOptions) -> str:
    """The run in one line: each section's degrees and ranks, the world and the backend."""

    def span(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs[0]}-{rs[-1]}"

    if opts.monolithic:
        parts = [f"the whole model on every rank (dp {nproc})"]
    else:
        parts = []
        layout = config.unit_layout()
        for unit, members in config.units().items():
            for name in members:
                sc = config.sections[name]
                degrees = [f"dp {sc.dp}"] + [
                    f"{k} {v}"
                    for k, v in (("fsdp", sc.fsdp), ("pp", sc.pp), ("cp", sc.cp), ("tp", sc.tp))
                    if v > 1
                ]
                frozen = ", frozen" if sc.frozen else ""
                parts.append(f"{name} {' x '.join(degrees)}{frozen} ({span(layout[unit])})")
    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    backend = "nccl on cuda" if cuda else "gloo on cpu"
    return f"{'; '.join(parts)}; {nproc} rank{'s' if nproc != 1 else ''}, {backend}"


def _device(opts: RunOptions, local_rank: int) -> torch.device:
    use_cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _elastic_store(rank: int, world: int, timeout: timedelta):
    """Under torchrun, a store whose keys are private to this restart attempt (else ``None``).

    torchrun's agent keeps one store across restarts, so without a per-attempt prefix a
    restarted rank can read a dead rank's gloo address from the previous attempt and fail
    with "connection refused" (observed with torch 2.13 and ``--max-restarts``).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=timeout,
        multi_tenant=not agent,
    )
    return dist.PrefixStore(f"maestro/attempt_{attempt}", store)


def worker_main(config: TrainConfig, opts: RunOptions) -> dict | None:
    """Train on this rank (environment as set by torchrun or ``launch``); rank 0 returns results."""
    opts.validate()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(opts, int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(config.threads)
    # spawned processes start from random RNG states: seed each rank from the run's seed so a
    # run (dropout masks included) is reproducible for its layout; resume restores the states
    from maestro.seeding import seed_for

    torch.manual_seed(seed_for("rank rng", config.seed, rank))
    timeout = timedelta(seconds=opts.timeout_s)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world,
        timeout=timeout,
        store=_elastic_store(rank, world, timeout),
    )
    if rank == 0 and opts.progress:
        phase(f"{world} ranks started")  # every rank has joined the process group
    try:
        out = _train(config, opts, rank, world, device)
        # every rank done communicating before any tears its process group down: a rank that
        # destroyed it while a peer still finished its last step aborted now and then under
        # torchrun ("terminate called without an active exception", docs/maestro/multi-node.md
        # under load)
        dist.barrier()
        return out
    except Exception as e:
        # before the process group goes: a peer that then loses its connection fails after
        # this report is in place, so the launcher sees the real error first
        _note_failure(e, rank)
        # where it happened, for this process's own report (under torchrun: no launcher)
        e.maestro_where = failures_where(rank)
        raise
    finally:
        dist.destroy_process_group()


def _train(config, opts, rank, world, device) -> dict | None:
    from maestro.runtime import costs
    from maestro.runtime.executor import MaestroWorker
    from maestro.runtime.monolithic import MonolithicWorker
    from maestro.runtime.trace import Tracer, write_chrome_trace

    tracer = Tracer(rank, "", keep_events=opts.trace is not None)
    cls = MonolithicWorker if opts.monolithic else MaestroWorker
    costs.defer_notes()  # shown after the first step: a forward that raises comes alone
    worker = cls(config, rank, world, device, tracer)
    worker.on_nonfinite = opts.on_nonfinite
    tracer.label = worker.label
    _HERE["section"] = worker.label
    if _PROGRESS is not None:
        _PROGRESS.set(section=worker.label)
    start, prior_losses, log, lr_steps = _resume(config, opts, rank, worker)
    # the LR schedule's total: the one the run started with (a resume keeps it)
    worker.lr_total_steps = lr_steps
    labels = [None] * world
    dist.all_gather_object(labels, worker.label)  # every rank has built its models
    if rank == 0 and opts.progress:
        phase("models built" + (f", resuming at step {start}" if start else ""))
    sections = [lab.split("[")[0] for lab in labels]
    from maestro.runtime import evaluation

    log_dir = run_log_dir(config, opts)
    mlog = None
    if rank == 0 and log_dir is not None:
        mlog = evaluation.MetricsLog(log_dir)
        print(f"logs: {log_dir} (tensorboard --logdir {log_dir})", flush=True)
    sinks = set(_sink_sections(config, opts.monolithic))
    evals: list[dict] = []
    bar = None
    if rank == 0 and opts.progress:
        import threading

        from tqdm import tqdm

        # tqdm's default lock holds a multiprocessing semaphore, which a rank stopped by a
        # signal never unlinks: the resource tracker then warned of a "leaked semaphore" on
        # every stop path; one process, one bar: a thread lock is all it needs
        tqdm.set_lock(threading.RLock())
        bar = tqdm(**_bar_kwargs(config, opts, start))
    losses: list[float] = [0.0] * config.steps
    losses[:start] = prior_losses
    skipped: list[int] = []
    # the first step warms up (allocations, first messages): time the rest from a common start
    warm = start + 1 if config.steps > start + 1 else start
    t_start, busy0 = time.time(), 0.0
    totals0: dict[str, float] = {}
    # Loss statistics are all-reduced asynchronously and waited one step later, so a rank
    # never waits for the others at a step boundary: a frozen section (no dependency on its
    # consumers) runs ahead into the next step, bounded to one step of lookahead.
    pending: deque = deque()

    last_row = [time.time()]

    def finish_oldest() -> None:
        step, stats, work = pending.popleft()
        work.wait()
        losses[step] = float(stats[0])
        if step == start:
            if rank == 0 and opts.progress:
                (bar.clear() if bar is not None else None)
                phase(f"first step done (loss {losses[step]:.4f})")
            for note in costs.deferred_notes():
                (bar.write if bar is not None else print)(note, file=sys.stderr)
        if stats[-1] > 0:
            skipped.append(step)
        if mlog is not None:
            mlog.write(_step_row(config, step, stats, sections, sinks, t_start, last_row, lr_steps))
        if bar is not None:
            if step >= warm:
                elapsed = max(time.time() - t_start, 1e-9)
                busy = _per_section(sections, stats[1 : 1 + world].cpu() / elapsed)
                rate = (step + 1 - warm) * config.global_batch / elapsed
                bar.set_postfix_str(
                    f"loss={losses[step]:.4f} samples/s={rate:.1f} "
                    + " ".join(f"{n}={b:.0%}" for n, b in busy.items())
                )
            bar.update(1)

    for step in range(start, config.steps):
        _HERE["step"] = step
        if _PROGRESS is not None:
            _PROGRESS.set(step=step)
        if step == warm:
            # every rank starts the timed window together (a frozen section may run ahead
            # later, but not across the window's start)
            while pending:
                finish_oldest()
            dist.barrier()
            t_start, busy0, totals0 = time.time(), tracer.busy, dict(tracer.totals)
        try:
            loss = worker.step(step)
        except SampleError as e:
            job = getattr(worker, "workload", None)
            describe = getattr(job, "describe_sample", None)
            e.locate(describe(step, e.sample_id) if describe else f" of step {step}")
            raise
        # [loss, busy seconds of each rank, each rank's loss share, each rank's peak memory,
        #  1 if the step was skipped (non-finite)]
        stats = torch.zeros(3 * world + 2, dtype=torch.float64, device=device)
        stats[0] = loss
        stats[1 + rank] = tracer.busy - busy0
        stats[1 + world + rank] = loss
        if log_dir is not None:
            stats[1 + 2 * world + rank] = evaluation.peak_memory_bytes(device)
        stats[-1] = float(worker.last_skipped)
        pending.append((step, stats, dist.all_reduce(stats, async_op=True)))
        if log is not None:
            rec = {"step": step, "section": worker.name, "ids": worker.last_ids}
            log.write(**rec, skipped=worker.last_skipped)
        while len(pending) > 1:
            finish_oldest()
        if config.eval is not None and (
            (step + 1) % config.eval.every == 0 or step + 1 == config.steps
        ):
            while pending:
                finish_oldest()
            t0, b0, tot0 = time.time(), tracer.busy, dict(tracer.totals)
            row = _evaluate(config, worker, step + 1, sections, rank, world)
            spent = time.time() - t0
            if row is not None:
                row["eval/seconds"] = spent
                evals.append(row)
                if mlog is not None:
                    mlog.write(row)
                if bar is not None:
                    bar.write(f"eval after {step + 1} steps: loss={row['eval/loss']:.4f}")
            # eval time is not training time: keep it out of samples/s and the busy fractions
            last_row[0] += spent
            if step >= warm:
                t_start += spent
                busy0 += tracer.busy - b0
                for c, v in tracer.totals.items():
                    totals0[c] = totals0.get(c, 0.0) + v - tot0.get(c, 0.0)
        if opts.checkpoint_every and (
            (step + 1) % opts.checkpoint_every == 0 or step + 1 == config.steps
        ):
            while pending:
                finish_oldest()
            with tracer.span("checkpoint", "checkpoint"):
                _save_checkpoint(config, opts, rank, world, worker, step + 1, losses)
    while pending:
        finish_oldest()
    worker.finish()
    elapsed = time.time() - t_start
    if log is not None:
        log.close()
    if mlog is not None:
        mlog.close()
    if bar is not None:
        bar.close()
    measured_steps = config.steps - warm
    busy_all = torch.zeros(world, dtype=torch.float64, device=device)
    busy_all[rank] = tracer.busy - busy0
    dist.all_reduce(busy_all)
    busy_frac = _per_section(sections, busy_all.cpu() / max(elapsed, 1e-9))

    totals = {c: v - totals0.get(c, 0.0) for c, v in tracer.totals.items()}
    all_totals = [None] * world
    dist.all_gather_object(all_totals, totals)
    # per rank: bytes of parameters, gradients and optimizer state (after the last step)
    mem = worker.state_bytes() if hasattr(worker, "state_bytes") else None
    if mem is not None and hasattr(worker, "predicted_memory"):
        # what the max_memory check predicted before the first step, per section
        mem["predicted"] = worker.predicted_memory()
    all_mem = [None] * world
    dist.all_gather_object(all_mem, (worker.label, mem))
    if opts.trace is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, (rank, worker.label, tracer.events))
        if rank == 0:
            write_chrome_trace(opts.trace, gathered)
    if opts.save_dir is not None:
        Path(opts.save_dir).mkdir(parents=True, exist_ok=True)
        for name, sd in worker.state_dicts().items():
            torch.save({k: v.cpu() for k, v in sd.items()}, Path(opts.save_dir) / f"{name}.pt")
    dist.barrier()
    if rank != 0:
        return None
    result = {
        "mode": "monolithic" if opts.monolithic else "maestro",
        "workload": config.workload,
        "world_size": world,
        "losses": losses,
        "start_step": start,
        "skipped_steps": skipped,
        "eval": evals,
        "elapsed_s": elapsed,
        "measured_steps": measured_steps,
        "samples_per_s": measured_steps * config.global_batch / elapsed,
        "busy": busy_frac,
        "seconds": _per_section_totals(sections, all_totals, measured_steps),
        "state_bytes": [
            {"rank": r, "label": lab, **(m or {})} for r, (lab, m) in enumerate(all_mem)
        ],
        "layout": {"model": {"dp": world, "micro_batch_size": config.monolithic_micro_batch_size}}
        if opts.monolithic
        else {
            n: {
                "dp": sc.dp,
                "fsdp": sc.fsdp,
                "tp": sc.tp,
                "pp": sc.pp,
                "cp": sc.cp,
                "zero": sc.zero,
                "recompute": sc.recompute,
                "micro_batch_size": sc.micro_batch_size,
                "frozen": sc.frozen,
            }
            for n, sc in config.sections.items()
        },
    }
    if opts.result is not None:
        Path(opts.result).write_text(json.dumps(result))
    if opts.progress:
        print(summary_table(result), flush=True)
    return result


def run_log_dir(config: TrainConfig, opts: RunOptions) -> str | None:
    """Where rank 0 logs: ``--log-dir``, else the config's ``log_dir`` (relative to the
    config's directory), else ``None``."""
    if opts.log_dir:
        return opts.log_dir
    if config.log_dir:
        p = Path(config.log_dir)
        if not p.is_absolute() and config.config_dir is not None:
            p = Path(config.config_dir) / p
        return str(p)
    return None


def _sink_sections(config: TrainConfig, monolithic: bool) -> list[str]:
    """The labels (``sections`` entries) whose ranks report loss: the sink units."""
    if monolithic:
        return ["model"]
    edges = config.section_inputs()
    used = {p for ins in edges.values() for p in ins}
    return [u for u, ms in config.units().items() if any(m not in used for m in ms)]


def _bar_kwargs(config: TrainConfig, opts: RunOptions, start: int) -> dict:
    """Rank 0's progress bar: over all ``config.steps``, from the step a resume starts at."""
    mode = "monolithic" if opts.monolithic else "maestro"
    return {
        "total": config.steps,
        "initial": start,
        "desc": f"{mode} {config.workload}",
        "unit": "step",
    }


def _step_row(
    config, step, stats, sections, sinks, t_start, last_row, lr_steps: int | None = None
) -> dict:
    """Rank 0's ``metrics.jsonl`` row of a training step (``maestro.runtime.evaluation``);
    ``lr_steps``: the LR schedule's total steps (default ``config.steps``)."""
    from maestro.runtime.local import lr_factor

    world = len(sections)
    vals = stats.cpu().tolist()
    now = time.time()
    dt, last_row[0] = max(now - last_row[0], 1e-9), now
    row: dict = {"step": step, "loss": vals[0]}
    per_loss: dict[str, float] = {}
    per_mem: dict[str, float] = {}
    for r, name in enumerate(sections):
        if name in sinks:
            per_loss[name] = per_loss.get(name, 0.0) + vals[1 + world + r]
        per_mem[name] = max(per_mem.get(name, 0.0), vals[1 + 2 * world + r])
    row.update({f"loss/{n}": v for n, v in per_loss.items()})
    for n, sc in config.sections.items():
        if not sc.frozen:
            row[f"lr/{n}"] = sc.lr * lr_factor(sc, step, lr_steps or config.steps)
    row["samples_per_s"] = config.global_batch / dt
    elapsed = max(now - t_start, 1e-9)
    busy = _per_section(sections, torch.tensor(vals[1 : 1 + world]) / elapsed)
    row.update({f"busy/{n}": v for n, v in busy.items()})
    row.update({f"peak_mem_bytes/{n}": v for n, v in per_mem.items()})
    row["skipped"] = int(vals[-1] > 0)
    return row


def _evaluate(config, worker, done: int, sections, rank: int, world: int) -> dict | None:
    """Every rank: run the eval batches (``worker.evaluate``); rank 0 returns the eval row."""
    from maestro.runtime import evaluation

    sums, norm, count = worker.evaluate(evaluation.eval_batches(worker.workload, config))
    gathered = [None] * world
    dist.all_gather_object(gathered, sums)
    if rank != 0:
        return None
    return evaluation.eval_row(done, gathered, norm, count, 0.0)


def _resume(config, opts, rank, worker):
    """Load the newest complete checkpoint when resuming; ``(start step, losses, sample log,
    the LR schedule's total steps)``.

    Rank 0 picks the checkpoint and broadcasts its step, so every rank loads the same one.
    The LR schedule keeps the total steps the run started with (``lr_schedule_steps`` in the
    checkpoint; ``config.steps`` for a fresh run or a checkpoint written without it).
    """
    from maestro.runtime import checkpoint as ck

    if not opts.checkpoint_dir:
        return 0, [], None, config.steps
    d = Path(opts.checkpoint_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    resume = opts.resume or attempt > 0
    choice = [None]
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        skipped: list[str] = []
        found = ck.latest(d, skipped)
        if resume:
            for line in skipped:
                print(f"maestro: {line}", file=sys.stderr, flush=True)
        if not resume and ck.has_manifests(d):
            choice[0] = "error: " + (
                f"{d} already holds checkpoints: pass --resume, or use an empty directory"
            )
        elif resume and found is not None:
            try:
                meta = found.meta()
                ck.check_compatible(found, meta, config)
                choice[0] = (found.next_step, found.sections, found.format)
                ck.discard_newer(d, found.next_step)
            except ValueError as e:
                choice[0] = f"error: {e}"
        elif resume and ck.has_manifests(d):
            choice[0] = f"error: no intact checkpoint in {d} to resume from"
        else:
            choice[0] = (0, [], "full")
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], str):
        raise ValueError(choice[0][len("error: ") :])
    start, sections, fmt = choice[0]
    prior: list[float] = []
    lr_steps = config.steps
    if start > 0:
        found = ck.Checkpoint(d, start, sections, fmt)
        meta = found.meta()
        worker.load_checkpoint(found)
        if rank < len(meta["rng"]):
            ck.set_rng_state(meta["rng"][rank])
        prior = list(meta["losses"])[:start]
        lr_steps = _lr_schedule_steps(meta, config, rank)
        if meta["scheduler"] != config.scheduler and rank == 0:
            print(
                f"maestro: resuming with scheduler {config.scheduler!r} (checkpoint used "
                f"{meta['scheduler']!r}): losses may differ from an uninterrupted run by rounding",
                flush=True,
            )
    log = ck.SampleLog(d, rank, attempt)
    log.write(resume_from=start)
    return start, prior, log, lr_steps


def _lr_schedule_steps(meta: dict, config: TrainConfig, rank: int) -> int:
    """The total steps a resumed run's LR schedule decays over: the checkpoint's (the run's
    ``steps`` for a checkpoint written without it). Rank 0 prints one line when that differs
    from ``config.steps`` and a trainable section's schedule depends on it (cosine, linear)."""
    lr_steps = meta.get("lr_schedule_steps") or config.steps
    if rank != 0 or lr_steps == config.steps:
        return lr_steps
    decaying = [
        n for n, sc in config.sections.items() if not sc.frozen and sc.lr_schedule != "constant"
    ]
    if not decaying:
        return lr_steps
    if config.steps > lr_steps:
        what = f"steps {lr_steps}-{config.steps - 1} train at its final LR"
    else:
        what = f"this run stops at step {config.steps}, before the schedule's end"
    print(
        f"maestro train: resuming a run started with steps = {lr_steps} under steps = "
        f"{config.steps}: the LR schedule ({', '.join(decaying)}) keeps decaying over "
        f"{lr_steps} steps ({what}); start a fresh run to change it",
        flush=True,
    )
    return lr_steps


def _save_checkpoint(config, opts, rank, world, worker, next_step, losses) -> None:
    """Collective: every section's replica 0 writes its state, rank 0 the run state, then the
    manifest once all files are in place."""
    from maestro.runtime import checkpoint as ck

    d = Path(opts.checkpoint_dir)
    worker.finish()  # every message of the finished steps is delivered
    fmt = opts.checkpoint_format
    if fmt == "sharded":
        states = worker.save_sharded(d, next_step)  # collective inside a sharded section
    else:
        states = worker.checkpoint_state()  # collective inside a sharded section
        for name, (module, optimizer) in states.items():
            ck.save_section(d, next_step, name, module, optimizer)
    rngs = [None] * world
    dist.all_gather_object(rngs, ck.rng_state())
    names = [None] * world
    dist.all_gather_object(names, list(states))
    if rank == 0:
        meta = {
            "next_step": next_step,
            "losses": losses[:next_step],
            "rng": rngs,
            "scheduler": config.scheduler,
            "scheduler_state": None,  # schedulers are pure functions of the batch
            # the LR schedule is a pure function of (step, this total): a resume keeps it
            "lr_schedule_steps": worker.lr_total_steps,
            "mode": "monolithic" if opts.monolithic else "maestro",
            "world_size": world,
            "fingerprint": ck.fingerprint(config),
            # the whole run config: `maestro export` rebuilds the job's sections from it
            "config": config.to_dict(),
        }
        ck.save_meta(d, next_step, meta)
    dist.barrier()  # every section file is in place before the manifest names it
    if rank == 0:
        ck.commit(d, next_step, sorted({n for ns in names for n in ns}), fmt)
    dist.barrier()


def _per_section(sections: list[str], per_rank: torch.Tensor) -> dict[str, float]:
    """Mean busy fraction over each section's replicas."""
    out: dict[str, list[float]] = {}
    for name, v in zip(sections, per_rank.tolist()):
        out.setdefault(name, []).append(v)
    return {n: sum(v) / len(v) for n, v in out.items()}


def _per_section_totals(
    sections: list[str], per_rank: list[dict[str, float]], steps: int
) -> dict[str, dict[str, float]]:
    """Mean seconds per step and category over each section's replicas."""
    out: dict[str, dict[str, float]] = {}
    count: dict[str, int] = {}
    for name, totals in zip(sections, per_rank):
        count[name] = count.get(name, 0) + 1
        d = out.setdefault(name, {})
        for cat, v in totals.items():
            d[cat] = d.get(cat, 0.0) + v / max(steps, 1)
    return {n: {c: v / count[n] for c, v in d.items()} for n, d in out.items()}


def _unit_layout(layout: dict, name: str, key: str) -> str:
    """A summary row's ``dp`` or micro-batch size: the section's, or a colocated group's
    (``"a+b"``) members' own, comma-separated in the name's order."""
    if name in layout:
        return str(layout[name].get(key, ""))
    members = name.split("+")
    if len(members) > 1 and all(m in layout for m in members):
        return ",".join(str(layout[m].get(key, "")) for m in members)
    return ""


def summary_table(result: dict) -> str:
    """The end-of-run table: per section, its layout, busy fraction and seconds per step
    (a colocated group's row lists its members' ``dp`` and ``mbs``, e.g. ``2,1``)."""
    cats = ["forward", "backward", "optimizer", "comm", "send", "wait", "schedule"]
    rows = [
        (
            name,
            _unit_layout(result["layout"], name, "dp"),
            _unit_layout(result["layout"], name, "micro_batch_size"),
            busy,
        )
        for name, busy in result["busy"].items()
    ]
    wn = max([10] + [len(r[0]) + 1 for r in rows])
    wd = max([4] + [len(r[1]) + 1 for r in rows])
    wm = max([5] + [len(r[2]) + 1 for r in rows])
    head = f"{'section':<{wn}}{'dp':>{wd}}{'mbs':>{wm}}{'busy':>7}" + "".join(
        f"{c:>10}" for c in cats
    )
    lines = [
        f"{result['mode']} {result['workload']} on {result['world_size']} ranks: "
        f"{result['samples_per_s']:.2f} samples/s over {result['measured_steps']} steps, "
        f"final loss {result['losses'][-1]:.4f} (seconds per step below)",
        head,
    ]
    for name, dp, mbs, busy in rows:
        sec = result["seconds"].get(name, {})
        lines.append(
            f"{name:<{wn}}{dp:>{wd}}{mbs:>{wm}}{busy:>7.0%}"
            + "".join(f"{sec.get(c, 0.0):>10.3f}" for c in cats)
        )
    return "\n".join(lines)


#: set in a spawned rank (``_spawn_entry``): where it reports its step and its failure
_PROGRESS = None
#: this rank's section label and step, for a failure's report under torchrun (no launcher)
_HERE: dict = {}
_REPORT_DIR: str | None = None


def failures_where(rank: int) -> dict:
    """This rank, its section label and step (the parts known): ``Failure`` fields."""
    return {"rank": rank, "section": _HERE.get("section"), "step": _HERE.get("step")}


def _note_failure(e: BaseException, rank: int):
    """In a spawned rank, write ``e`` (classified) for the launcher, once; its ``Failure``."""
    from maestro.runtime import failures

    if _REPORT_DIR is None:
        return None
    noted = getattr(e, "_maestro_failure", None)
    if noted is not None:
        return noted
    try:
        f = failures.classify(e)
        f.rank = rank
        if _PROGRESS is not None:
            f.step, f.section = _PROGRESS.step, _PROGRESS.section
        failures.write_report(_REPORT_DIR, rank, f)
        e._maestro_failure = f
        return f
    except Exception:  # the report is a courtesy: the rank's own error comes back anyway
        return None


def _die_with_launcher(launcher_pid: int | None) -> None:
    """This rank gets SIGKILL when the launcher dies, even by SIGKILL (its own handler stops
    the ranks on SIGTERM/SIGINT): on Linux when its parent dies (``PR_SET_PDEATHSIG``: the
    launcher under spawn, the fork server under forkserver), and when the launcher's process
    ends (a watcher thread on a pidfd, else polling) since a fork server outlives the
    launcher for as long as any rank it forked runs."""
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if launcher_pid is None:
        return

    def watch() -> None:
        import select

        try:
            fd = os.pidfd_open(launcher_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(launcher_pid, 0)
                except ProcessLookupError:
                    break
                except OSError:
                    pass
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="maestro-launcher-watch", daemon=True).start()


def _append_own_output() -> None:
    """Put the launcher's own stdout/stderr in append mode when they are regular files.

    The ranks reopen them with ``O_APPEND`` and write at the file's end; a handle opened
    by ``2> log`` keeps its own offset (near 0), so without this the launcher's final
    line overwrote the beginning of the log instead of ending it. Pipes and terminals
    have no offset and are left alone.
    """
    import fcntl
    import stat

    for fd in (1, 2):
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            continue


def _parent_state(method: str):
    """What a rank must take from the launcher as it is *now*: a fork server's children
    inherit the server's environment, ``sys.path``, working directory and stdout/stderr from
    when it started, not the launcher's current ones (fault hooks, a user package on the
    path, captured output). ``None`` under spawn, which passes them itself."""
    import sys

    if method != "forkserver":
        return None
    return {"env": dict(os.environ), "path": list(sys.path), "cwd": os.getcwd(), "pid": os.getpid()}


def _take_parent_state(state) -> None:
    import sys

    if state is None:
        return
    os.environ.clear()
    os.environ.update(state["env"])
    sys.path[:] = state["path"]
    os.chdir(state["cwd"])
    for fd in (1, 2):
        # the launcher's stdout/stderr as they are now (Linux: reopened through /proc;
        # elsewhere the fork server's are kept)
        try:
            new = os.open(f"/proc/{state['pid']}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(new, fd)
        os.close(new)


def _spawn_entry(
    local_rank: int,
    world: int,
    port: int,
    cfg: dict,
    opts: RunOptions,
    state=None,
    report_dir: str | None = None,
    launcher_pid: int | None = None,
) -> None:
    global _PROGRESS, _REPORT_DIR

    _die_with_launcher(launcher_pid)
    _take_parent_state(state)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
    )
    if report_dir is not None:
        from maestro.runtime.failures import Progress, progress_path

        _REPORT_DIR = report_dir
        _PROGRESS = Progress(progress_path(report_dir, local_rank))
    try:
        worker_main(from_dict(cfg), opts)
    except Exception as e:
        f = _note_failure(e, local_rank)
        linger = os.environ.get("MAESTRO_FAULT_LINGER_S")
        if linger and f is not None and f.kind != "secondary":
            # test hook (maestro.runtime.faults): the failing rank exits late, so the
            # launcher first sees a peer's lost connection
            time.sleep(float(linger))
        raise


def launch(
    config: TrainConfig,
    nproc: int | None = None,
    opts: RunOptions | None = None,
    timeout_s: float = 900.0,
) -> dict:
    """Spawn ``nproc`` local ranks (default: ``sum(dp)``), train, and return rank 0's result.

    ``ValueError`` when a Maestro run's ``sum(dp)`` differs from ``nproc``, or a rank's config
    error; ``NonFiniteError`` as a rank raised it; ``failures.RankFailed`` when a rank raised
    anything else (the first real error, not a peer's lost connection) or died;
    ``TimeoutError`` (after terminating the ranks) when the run exceeds ``timeout_s``;
    ``failures.Stopped`` when SIGTERM or SIGINT reached this process (called from the main
    thread): every rank is then stopped (SIGTERM, SIGKILL after 2 s) before it propagates,
    and both signals stay ignored (the process is stopping: a second signal changes nothing);
    a caller that carries on calls ``e.restore_signals()`` to take its handlers back.
    """
    opts = opts or RunOptions()
    nproc = config.world_size if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not opts.monolithic:
        config.check_world_size(nproc)
    opts.validate()
    staged = [n for n, sc in config.sections.items() if sc.pp > 1]
    if staged and opts.checkpoint_format == "sharded" and not opts.monolithic:
        raise ValueError(
            f"--checkpoint-format sharded: section {staged[0]!r} is pipelined (pp > 1), "
            "which writes full checkpoints only; use --checkpoint-format full"
        )
    job = getattr(config, "_job", None)  # a user's job, built when its config was validated
    if job is not None:
        job.bind(config).check_batch_fits()  # before any rank starts
    if run_log_dir(config, opts) is not None:
        from maestro.runtime.evaluation import check_tensorboard

        check_tensorboard()
    if opts.progress:
        phase(f"{describe_layout(config, nproc, opts)}; starting the ranks")
    from maestro.prestart import start_method

    method = start_method()
    # torch warns for each rank it terminates after another failed: the launcher's report
    # says what failed
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        return _launch(config, nproc, opts, timeout_s, method)
    finally:
        spawn_log.setLevel(level)


def _launch(config, nproc: int, opts: RunOptions, timeout_s: float, method: str) -> dict:
    import torch.multiprocessing as mp

    from maestro.runtime.failures import Stopped

    _append_own_output()  # before the ranks share these handles
    with tempfile.TemporaryDirectory() as tmp, _stop_on_signals():
        result_path = opts.result or str(Path(tmp) / "result.json")
        run_opts = RunOptions(**{**opts.__dict__, "result": result_path})
        ctx = None
        try:
            ctx = mp.start_processes(
                _spawn_entry,
                args=(
                    nproc,
                    free_port(),
                    config.to_dict(),
                    run_opts,
                    _parent_state(method),
                    tmp,
                    os.getpid(),
                ),
                nprocs=nproc,
                join=False,
                start_method=method,
            )
            deadline = time.time() + timeout_s
            while not ctx.join(timeout=1.0):
                if time.time() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    raise TimeoutError(f"training did not finish within {timeout_s:.0f} s")
        except Stopped as e:
            _stop_ranks(ctx.processes if ctx is not None else None)
            e.step = _current_step(tmp, nproc)
            raise
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            _raise_rank_failure(e, tmp, nproc, ctx)
            raise
        return json.loads(Path(result_path).read_text())


class _stop_on_signals:
    """While open (main thread only): SIGTERM and SIGINT raise ``Stopped`` once, then are
    ignored until the launcher has stopped its ranks; the previous handlers come back after."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        import threading

        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        from maestro.runtime.failures import Stopped

        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    def restore(self) -> None:
        """The caller's handlers back."""
        for sig, old in self.saved.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self.saved = {}

    def __exit__(self, exc_type, exc, tb):
        from maestro.runtime.failures import Stopped

        if isinstance(exc, Stopped):
            # a stopping process keeps ignoring both signals until it has reported and exited
            # (a second Ctrl-C must not cut the report short or change the exit code); a caller
            # that carries on takes its handlers back with ``exc.restore_signals()``
            exc.restore_signals = self.restore
        else:
            self.restore()
        return False


def _stop_ranks(processes, grace_s: float = 2.0) -> None:
    """SIGTERM every rank, SIGKILL what is left after ``grace_s``, then stop (and reap) the
    fork server and the resource tracker, so nothing outlives the launcher."""
    import multiprocessing as std_mp
    from multiprocessing import forkserver, resource_tracker

    procs = list(processes) if processes is not None else std_mp.active_children()
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(1.0)
    # both helpers exit when their "alive" pipe closes (private attributes: best effort)
    for helper, fd_attr, pid_attr in (
        (getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", "_forkserver_pid"),
        (getattr(resource_tracker, "_resource_tracker", None), "_fd", "_pid"),
    ):
        fd, pid = getattr(helper, fd_attr, None), getattr(helper, pid_attr, None)
        if fd is None or pid is None:
            continue
        try:
            os.close(fd)
            setattr(helper, fd_attr, None)
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    setattr(helper, pid_attr, None)
                    break
                time.sleep(0.02)
        except (OSError, AttributeError):
            pass


def _current_step(report_dir: str, nproc: int) -> int | None:
    """The lowest step a rank was in (``None`` before the first step)."""
    from maestro.runtime.failures import Progress, progress_path

    steps = [Progress.read(progress_path(report_dir, r)).get("step") for r in range(nproc)]
    steps = [s for s in steps if s is not None]
    return min(steps) if steps else None


def _raise_rank_failure(e: Exception, report_dir: str, nproc: int, ctx) -> None:
    """Raise what the ranks' reports say failed first: a config error as ``ValueError``, a
    non-finite step as ``NonFiniteError``, anything else as ``RankFailed``."""
    from maestro.runtime import failures
    from maestro.runtime.faults import NonFiniteError

    reports = failures.read_reports(report_dir, nproc)
    reported = {f.rank for f in reports}
    # the rank that exited first without a report (torch's pick), else any that exited
    # non-zero without one; the ranks torch's clean-up terminated exit by SIGTERM: no cause
    dead = []
    first = getattr(e, "error_index", None)
    if first is not None and first not in reported and ctx is not None:
        dead.append(first)
    for r, p in enumerate(ctx.processes if ctx is not None else ()):
        if p.exitcode not in (None, 0, -signal.SIGTERM) and r not in reported and r not in dead:
            dead.append(r)
    died = None
    if dead:
        r = dead[0]
        progress = failures.Progress.read(failures.progress_path(report_dir, r))
        died = failures.death(r, ctx.processes[r].exitcode, progress)
    f = failures.pick(reports, died)
    if f is None:
        _reraise_rank_error(e)
        return
    if f.kind == "config":
        raise ValueError(f.message) from None
    if f.kind == "nonfinite":
        raise NonFiniteError(f.message) from None
    raise failures.RankFailed(f) from None


def _reraise_rank_error(e: Exception) -> None:
    """Re-raise a rank's ``ValueError``/``NonFiniteError`` (from its traceback text, when it
    left no report) as itself (one line for the CLI)."""
    from maestro.runtime.faults import NonFiniteError

    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    for cls in (NonFiniteError, ValueError):
        for prefix in (f"{cls.__module__}.{cls.__name__}: ", f"{cls.__name__}: "):
            if last.startswith(prefix):
                raise cls(last[len(prefix) :]) from None
