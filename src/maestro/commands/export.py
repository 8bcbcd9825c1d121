"""``maestro export CHECKPOINT_DIR --section NAME --out DIR``: a trained section in the format
people load (``maestro.export``)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained section of a checkpoint as a Hugging Face save_pretrained "
        "directory (or safetensors for your own module)",
        description="Read the newest complete checkpoint of CHECKPOINT_DIR (full or sharded, "
        "any layout: shards are merged in this process) and write one section: a Hugging Face "
        "model as a save_pretrained directory (config, safetensors weights, the job's "
        "tokenizer) that AutoModelForCausalLM.from_pretrained loads; any other module as "
        "model.safetensors and maestro_section.json, loadable with maestro.load_section(DIR).",
    )
    p.add_argument("checkpoint_dir", help="the --checkpoint-dir of a maestro train run")
    p.add_argument("--section", required=True, metavar="NAME", help="the section to export")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "fp32", "bf16"],
        default=None,
        help="floating dtype of the written weights (default: as in the checkpoint, e.g. a "
        "trainable section's fp32 master weights)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace --out when it exists and is not empty"
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="RUN.toml",
        help="the run's config, for checkpoints that record none (older Maestro versions)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maestro.export import export

    done = export(
        args.checkpoint_dir,
        args.section,
        args.out,
        dtype=args.dtype,
        force=args.force,
        config=args.config,
    )
    print(done.line())
    return 0
