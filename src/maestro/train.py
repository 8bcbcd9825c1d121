"""``python -m maestro.train CONFIG``: train under torchrun, or spawn local ranks.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set, no ``--nproc``) this process is one rank::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m maestro.train run.toml

Otherwise ``--nproc N`` (default: the config's ``sum(dp)``) spawns N local ranks; this is what
``maestro train`` does.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options shared by ``maestro train`` and ``python -m maestro.train``."""
    p.add_argument("config", help="TOML run config (see examples/)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to spawn (default: sum of the sections' dp; ignored under torchrun)",
    )
    p.add_argument(
        "--monolithic",
        action="store_true",
        help="baseline: the whole model on every rank, data parallel, one micro-batch size",
    )
    p.add_argument(
        "--mbs", type=int, default=None, help="micro-batch size of --monolithic (overrides config)"
    )
    p.add_argument("--steps", type=int, default=None, help="override the config's steps")
    p.add_argument("--scheduler", default=None, help="override the config's scheduler")
    p.add_argument("--trace", default=None, metavar="OUT.json", help="write a Chrome trace")
    p.add_argument("--save-dir", default=None, help="save each section's final weights here")
    p.add_argument("--result", default=None, metavar="OUT.json", help="write rank 0's results")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: CUDA with NCCL when a GPU is present, else CPU with gloo (default auto)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary table")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="write an atomic checkpoint every K steps and after the last (needs --checkpoint-dir)",
    )
    p.add_argument(
        "--checkpoint-dir", default=None, metavar="D", help="checkpoints and sample-id logs"
    )
    p.add_argument(
        "--checkpoint-format",
        choices=["full", "sharded"],
        default="full",
        help="full: each section's whole state in one file (default); sharded: every rank "
        "writes its own shards with torch.distributed.checkpoint (resumes under any layout)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir (from step 0 if "
        "none); a torchrun restart always resumes",
    )
    p.add_argument(
        "--emulate",
        default=None,
        metavar="SCENARIO",
        help="emulated devices: run this layout with every compute a wait of the SCENARIO's "
        "(kd | mllm | mllm-audio) GPU cost model; no model runs (maestro.emulate)",
    )
    p.add_argument("--emulate-gpu", default="H100", help="GPU preset of --emulate (H100, H200)")
    p.add_argument(
        "--emulate-time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply every emulated wait by X (e.g. 0.1 for a quick check)",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="NaN/inf loss or gradient: stop naming the section and step (default), or skip "
        "the step's update on every rank",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="rank 0 writes TensorBoard event files and metrics.jsonl (loss, per-section loss, "
        "lr, samples/s, busy, peak memory; eval/ rows with [eval]) here; overrides the "
        "config's log_dir",
    )
    p.add_argument(
        "--export-on-finish",
        action="append",
        default=None,
        metavar="NAME",
        help="after the last step, export section NAME (repeatable) as maestro export does, to "
        "CHECKPOINT_DIR/export/NAME (replaced if present); needs --checkpoint-dir and writes "
        "a checkpoint after the last step even without --checkpoint-every",
    )
    p.add_argument(
        "--export-dtype",
        choices=["float32", "bfloat16", "fp32", "bf16"],
        default=None,
        help="dtype of --export-on-finish's weights (default: as in the checkpoint)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="on a failure, print the full traceback (default: one line, and for an error in "
        "your own code its frames only)",
    )


def _process_start(default: float) -> float:
    """When this process started (wall clock; Linux ``/proc``), else ``default``: the
    start-up lines count the interpreter's own start too."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default
    start = default - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    return start if default - 60 < start <= default else default


def run(args: argparse.Namespace) -> int:
    """Load and validate the config, then train (torchrun rank or local launcher)."""
    import time

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and args.nproc is None
    if under_torchrun:
        # each rank's own clock: a value in the environment is some other launcher's (e.g.
        # one that ran in the process that started torchrun)
        os.environ.pop("MAESTRO_T0", None)
    else:
        # the start-up lines' clock (``launch.phase``), also in the ranks; set afresh, since
        # an earlier run in this process (the Python API, tests) left its own
        os.environ["MAESTRO_T0"] = repr(_process_start(time.time()))
    if not args.quiet and os.environ.get("RANK", "0") == "0":
        # before torch and the user's job are imported (about a second)
        print(f"maestro train: loading {args.config}", file=sys.stderr, flush=True)
    if not under_torchrun:
        from maestro import prestart

        prestart.prestart()  # it imports torch while this process loads the job
    from maestro import config as C
    from maestro.runtime.launch import RunOptions, launch, worker_main

    cfg = C.load(args.config)
    over = {}
    if args.steps is not None:
        over["steps"] = args.steps
    if args.scheduler is not None:
        over["scheduler"] = args.scheduler
    if args.mbs is not None:
        over["monolithic_micro_batch_size"] = args.mbs
    if over:
        d = cfg.to_dict()
        d.update(over)
        cfg = C.from_dict(d)
    if args.emulate is not None:
        from maestro.emulate import NOTICE, emulated_config

        cfg = emulated_config(
            cfg,
            args.emulate,
            monolithic=args.monolithic,
            world=args.nproc,
            gpu=args.emulate_gpu,
            time_scale=args.emulate_time_scale,
        )
        if not args.quiet:
            print(NOTICE.format(gpu=args.emulate_gpu, scenario=args.emulate), flush=True)
    elif args.monolithic and any(sc.tp > 1 or sc.fsdp > 1 for sc in cfg.sections.values()):
        print(
            "maestro train: note: --monolithic runs plain replicas; the sections' tp and fsdp "
            "are priced only under --emulate",
            file=sys.stderr,
        )
    exports = _check_exports(args, cfg)
    opts = RunOptions(
        monolithic=args.monolithic,
        trace=args.trace,
        save_dir=args.save_dir,
        result=args.result,
        progress=not args.quiet,
        device=args.device,
        checkpoint_every=args.checkpoint_every or (cfg.steps if exports else 0),
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        checkpoint_format=args.checkpoint_format,
        on_nonfinite=args.on_nonfinite,
        log_dir=getattr(args, "log_dir", None),
    )
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if not args.monolithic:
            cfg.check_world_size(world)
        worker_main(cfg, opts)
        if int(os.environ["RANK"]) == 0:
            _export_on_finish(args, exports)
        return 0
    result = launch(cfg, args.nproc, opts)
    if args.emulate is not None:
        _report_emulation(cfg, args, result)
    _export_on_finish(args, exports)
    return 0


def _check_exports(args, cfg) -> list[str]:
    """The sections of ``--export-on-finish``, checked before any rank starts."""
    names = list(getattr(args, "export_on_finish", None) or [])
    if not names:
        return []
    if not args.checkpoint_dir:
        raise ValueError(
            "--export-on-finish needs --checkpoint-dir (it exports the last checkpoint)"
        )
    if args.emulate is not None:
        raise ValueError("--export-on-finish exports trained weights; --emulate trains none")
    for n in names:
        if n not in cfg.sections:
            raise ValueError(
                f"--export-on-finish: no section {n!r}; known: {', '.join(cfg.sections)}"
            )
    return names


def _export_on_finish(args, names: list[str]) -> None:
    """Export each section of ``--export-on-finish`` from the run's last checkpoint."""
    from pathlib import Path

    from maestro.export import export

    for n in names:
        out = Path(args.checkpoint_dir) / "export" / n
        done = export(args.checkpoint_dir, n, out, dtype=args.export_dtype, force=True)
        if not args.quiet:
            print(f"maestro train: {done.line()}", flush=True)


def _report_emulation(cfg, args, result: dict) -> None:
    """Print (and add to ``--result``) the measured step against the simulator's replay of
    the same schedule."""
    import json
    from pathlib import Path

    from maestro.emulate import NOTICE
    from maestro.emulate.predict import predict

    steps = result["measured_steps"]
    measured = result["elapsed_s"] / max(steps, 1) / args.emulate_time_scale
    pred = predict(cfg, monolithic=args.monolithic, world=result["world_size"], steps=steps)
    result["emulation"] = {
        "notice": NOTICE.format(gpu=args.emulate_gpu, scenario=args.emulate),
        "scenario": args.emulate,
        "gpu": args.emulate_gpu,
        "time_scale": args.emulate_time_scale,
        "measured_step_s": measured,
        "simulated_window_step_s": pred.window,
        "simulated_period_s": pred.period,
        "error": measured / pred.window - 1.0 if pred.window > 0 else None,
    }
    if args.result is not None:
        Path(args.result).write_text(json.dumps(result))
    if not args.quiet:
        print(
            f"emulated step {measured:.3f} s vs simulated {pred.window:.3f} s over the same "
            f"{pred.steps} steps from idle ({measured / pred.window - 1:+.1%}; steady-state "
            f"period {pred.period:.3f} s); {args.emulate_gpu} time, emulated",
            flush=True,
        )


def run_reporting(
    args: argparse.Namespace, prog: str, command: str | None = None, argv: list[str] | None = None
) -> int:
    """``run(args)``, every failure reported as ``maestro.runtime.failures.report`` shows it
    (a rank's death or a stop by SIGTERM/SIGINT with how to resume); the exit code.
    ``command`` and ``argv``: the command line the resume hint repeats (default: ``prog``
    and ``sys.argv[1:]`` less the sub-command)."""
    try:
        return run(args)
    except BaseException as e:
        # imported here: maestro.runtime imports torch, and ``run`` speaks before that
        from maestro import prestart
        from maestro.runtime.failures import RankFailed, Stopped, report, resume_hint

        prestart.stop()  # started early (``run``): it must not outlive a failed start
        hint = None
        if isinstance(e, (Stopped, RankFailed)):
            if argv is None:
                argv = sys.argv[1:]
                if argv[:1] == ["train"]:
                    argv = argv[1:]
            hint = resume_hint(command or prog, argv, args.checkpoint_dir)
        code = report(e, prog, debug=args.debug, hint=hint, after_bar=not args.quiet)
        if code is None:
            raise
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maestro.train", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        argv = sys.argv[1:] if argv is None else argv
        return run_reporting(args, "maestro.train", "python -m maestro.train", argv)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"maestro.train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
