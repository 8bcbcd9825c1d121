"""Train a GNN checkpoint on a prepared dataset with Quiver's sampler (``quiver train-model``).

Mini-batch training in the GraphSAGE style: sample each batch's k-hop neighbourhood, gather its
features, step on the seeds' cross-entropy. A features-only MLP trained on the same seeds for
the same number of steps is reported beside it, so a user sees what the graph adds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from quiver.models import FeatureMLP, ModelConfig, build_model, save_checkpoint


@dataclass
class TrainConfig:
    """How to train.

    Args:
        model: ``"sage"``, ``"gcn"`` or ``"gat"`` (default ``"sage"``).
        fanouts: per-hop fanouts, seeds' hop first; also the number of layers (default: the
            dataset manifest's ``fanouts``).
        hidden_dim: hidden width (default 128).
        epochs: passes over the training nodes (default 3).
        batch_size: seeds per step (default 512).
        lr: Adam learning rate (default 3e-3).
        max_steps_per_epoch: cap on steps per epoch, for large datasets (default: no cap).
        max_eval_nodes: validation nodes evaluated (default 5,000, a random subset).
        seed: seeds model initialisation, shuffling and sampling (default 0).
        compare_mlp: also train a features-only MLP and report its accuracy (default True).
    """

    model: str = "sage"
    fanouts: tuple[int, ...] | None = None
    hidden_dim: int = 128
    epochs: int = 3
    batch_size: int = 512
    lr: float = 3e-3
    max_steps_per_epoch: int | None = None
    max_eval_nodes: int = 5000
    seed: int = 0
    compare_mlp: bool = True

    def __post_init__(self):
        for name in ("hidden_dim", "epochs", "batch_size", "max_eval_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.fanouts is not None and (
            not self.fanouts or any(int(k) == 0 or int(k) < -1 for k in self.fanouts)
        ):
            raise ValueError(f"fanouts must be positive (or -1 for all), got {self.fanouts}")


@dataclass
class TrainReport:
    """What training achieved: validation accuracy of the GNN and of the features-only MLP."""

    val_acc: float
    mlp_val_acc: float | None
    steps: int
    seconds: float


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean()) if len(y) else float("nan")


def train_model(ds, cfg: TrainConfig, out=None, progress: bool = True):
    """Train a GNN on a ``quiver.datasets.PreparedDataset``; optionally save it to ``out``.

    The checkpoint at ``out`` is the one format ``quiver serve`` loads for any model
    (``quiver.usermodel.save_model``): the ``state_dict``, the factory
    ``quiver.models:sampled_gnn`` with its ``factory_kwargs``, the ``fanouts``, and the
    validation accuracies.

    Returns ``(model, TrainReport)``.
    """
    from tqdm import tqdm

    from quiver.pyg import GraphSageSampler

    fanouts = list(cfg.fanouts or ds.manifest.get("fanouts") or [15, 10, 5])
    train_ids = ds.splits["train"]
    valid_ids = ds.splits.get("valid", torch.empty(0, dtype=torch.long))
    if len(train_ids) == 0:
        raise ValueError("the dataset has no training nodes (split/train.npy is empty)")
    y_all = ds.labels
    if (y_all[train_ids] < 0).any():
        raise ValueError("some training nodes have no label (-1)")
    num_classes = ds.num_classes
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    mcfg = ModelConfig(
        cfg.model,
        in_dim=int(ds.features.shape[1]),
        out_dim=num_classes,
        hidden_dim=cfg.hidden_dim,
        num_layers=len(fanouts),
    )
    model = build_model(mcfg)
    mlp = FeatureMLP(mcfg.in_dim, cfg.hidden_dim, num_classes, len(fanouts))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    mlp_opt = torch.optim.Adam(mlp.parameters(), lr=cfg.lr)
    sampler = GraphSageSampler(ds.topo, fanouts, mode="CPU", seed=cfg.seed)
    loss_fn = nn.CrossEntropyLoss()
    x_all = ds.features
    steps_per_epoch = -(-len(train_ids) // cfg.batch_size)
    if cfg.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    t0 = time.perf_counter()
    steps = 0
    bar = tqdm(total=cfg.epochs * steps_per_epoch, desc=f"train {cfg.model}", disable=not progress)
    for _epoch in range(cfg.epochs):
        perm = train_ids[torch.from_numpy(rng.permutation(len(train_ids)))]
        model.train()
        mlp.train()
        for i in range(steps_per_epoch):
            seeds = perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            n_id, bs, adjs = sampler.sample(seeds)
            x = x_all[n_id].float()
            y = y_all[seeds]
            loss = loss_fn(model(x, adjs), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if cfg.compare_mlp:
                mlp_loss = loss_fn(mlp(x[:bs]), y)
                mlp_opt.zero_grad()
                mlp_loss.backward()
                mlp_opt.step()
            steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    val_acc, mlp_acc = evaluate(
        model, mlp if cfg.compare_mlp else None, ds, sampler, valid_ids, cfg, rng
    )
    report = TrainReport(val_acc, mlp_acc, steps, time.perf_counter() - t0)
    if out is not None:
        save_checkpoint(
            out,
            model,
            extra={
                "fanouts": fanouts,
                "val_acc": val_acc,
                "mlp_val_acc": mlp_acc,
                "dataset": ds.manifest.get("name"),
            },
        )
    return model, report


@torch.inference_mode()
def evaluate(model, mlp, ds, sampler, ids, cfg: TrainConfig, rng) -> tuple[float, float | None]:
    """Accuracy of the GNN (and the MLP) on up to ``cfg.max_eval_nodes`` of ``ids``."""
    if len(ids) == 0:
        return float("nan"), None
    if len(ids) > cfg.max_eval_nodes:
        ids = ids[torch.from_numpy(rng.choice(len(ids), cfg.max_eval_nodes, replace=False))]
    model.eval()
    preds, mlp_preds, ys = [], [], []
    for i in range(0, len(ids), cfg.batch_size):
        seeds = ids[i : i + cfg.batch_size]
        n_id, bs, adjs = sampler.sample(seeds)
        x = ds.features[n_id].float()
        preds.append(model(x, adjs).argmax(1))
        if mlp is not None:
            mlp.eval()
            mlp_preds.append(mlp(x[:bs]).argmax(1))
        ys.append(ds.labels[seeds])
    y = torch.cat(ys)
    acc = float((torch.cat(preds) == y).float().mean())
    mlp_acc = float((torch.cat(mlp_preds) == y).float().mean()) if mlp is not None else None
    return acc, mlp_acc
