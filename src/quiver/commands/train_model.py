"""``quiver train-model DATASET_DIR --model sage --out ckpt.pt``: train a servable checkpoint."""

from __future__ import annotations

import argparse


def _fanouts(text: str | None):
    if text is None:
        return None
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise ValueError(f"--fanouts must be comma-separated integers, got {text!r}") from None


def register(sub) -> None:
    p = sub.add_parser(
        "train-model",
        help="train a GNN checkpoint on a prepared dataset with Quiver's sampler",
        description=(
            "Mini-batch training with Quiver's CPU sampler; prints validation accuracy beside a "
            "features-only MLP trained on the same seeds, and saves a checkpoint `quiver serve` "
            "loads."
        ),
    )
    p.add_argument("dataset_dir", metavar="DATASET_DIR", help="a directory from `quiver prepare`")
    p.add_argument("--model", default="sage", choices=["sage", "gcn", "gat"], help="(sage)")
    p.add_argument("--out", required=True, help="checkpoint path to write, e.g. ckpt.pt")
    p.add_argument("--fanouts", default=None, help="e.g. 15,10,5 (default: the manifest's)")
    p.add_argument("--hidden", type=int, default=128, help="hidden width (128)")
    p.add_argument("--epochs", type=int, default=3, help="epochs (3)")
    p.add_argument("--batch-size", type=int, default=512, help="seeds per step (512)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (3e-3)")
    p.add_argument("--max-steps-per-epoch", type=int, default=None, help="cap per epoch")
    p.add_argument("--seed", type=int, default=0, help="seed (0)")
    p.add_argument("--no-mlp", action="store_true", help="skip the features-only MLP baseline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from quiver.datasets import load_prepared
    from quiver.training import TrainConfig, train_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = TrainConfig(
        model=args.model,
        fanouts=_fanouts(args.fanouts),
        hidden_dim=args.hidden,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        max_steps_per_epoch=args.max_steps_per_epoch,
        seed=args.seed,
        compare_mlp=not args.no_mlp,
    )
    ds = load_prepared(args.dataset_dir)
    _, rep = train_model(ds, cfg, out=args.out)
    print(f"validation accuracy: {args.model} {rep.val_acc:.4f}", end="")
    if rep.mlp_val_acc is not None:
        print(f"  |  features-only MLP {rep.mlp_val_acc:.4f}", end="")
    print(f"  ({rep.steps} steps, {rep.seconds:.1f} s)")
    print(f"checkpoint written to {args.out}")
    return 0
