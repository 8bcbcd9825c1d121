"""``maestro estimate``: one training job on one layout -> step time, tokens/s per GPU, MFU,
peak memory per GPU and where the time goes (the cost model the planner uses)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    from maestro.estimate.framework import FRAMEWORKS
    from maestro.estimate.hardware import HARDWARE
    from maestro.estimate.models import PRESETS

    p = sub.add_parser(
        "estimate",
        help="price one model on one parallel layout (step time, MFU, memory)",
        description=(
            "Estimate one training step of MODEL (a preset or a Hugging Face config.json) on "
            "GPUS GPUs split as dp x fsdp x tp x pp x cp. Presets: "
            + ", ".join(PRESETS)
            + ". Example: maestro estimate llama3-8b --gpus 8 --seq-len 8192 "
            "--micro-batch 2 --recompute selective --hardware h100-96g-500w"
        ),
    )
    p.add_argument("model", metavar="MODEL", help="preset name or path to config.json / its dir")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the job (default 8)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sample (default 4096)")
    p.add_argument(
        "--micro-batch", type=int, default=1, help="samples per micro-batch per rank (default 1)"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per step (default: one micro-batch per data-parallel rank)",
    )
    for name, what in (
        ("dp", "data-parallel replicas (HSDP replicas with --fsdp)"),
        ("fsdp", "FSDP shard degree (default: every data-parallel rank, torchtitan's 1-D FSDP)"),
    ):
        p.add_argument(f"--{name}", type=int, default=None, help=what)
    for name, what in (
        ("tp", "tensor-parallel degree"),
        ("pp", "pipeline stages"),
        ("cp", "context-parallel degree"),
        ("vpp", "virtual stages per pipeline rank (interleaved 1F1B)"),
    ):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{what} (default 1)")
    p.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="selective",
        help="activation recompute (default selective: torchtitan's op-level policy)",
    )
    p.add_argument("--dtype", default="bf16", help="compute dtype (bf16 only)")
    p.add_argument(
        "--hardware",
        default="h100-sxm",
        help=f"accelerator: {', '.join(HARDWARE)} (default h100-sxm)",
    )
    p.add_argument(
        "--framework",
        default="torchtitan",
        help=f"how the step runs: {', '.join(FRAMEWORKS)} (default torchtitan: PyTorch eager, "
        "what maestro train runs)",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from maestro.estimate import estimate

    e = estimate(
        args.model,
        gpus=args.gpus,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        dp=args.dp,
        fsdp=args.fsdp,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        vpp=args.vpp,
        recompute=args.recompute,
        dtype=args.dtype,
        hardware_name=args.hardware,
        framework_name=args.framework,
    )
    if not e.fits:
        raise ValueError(e.notes[0])
    print(json.dumps(e.to_dict(), indent=1) if args.json else e.table())
    return 0
