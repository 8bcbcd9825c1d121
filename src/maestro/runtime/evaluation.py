"""Held-out evaluation (the run config's ``[eval]`` table) and rank 0's run logs (``--log-dir``).

Eval data: ``[eval] data = "eval.jsonl"`` (relative to the config) is read like the job's own
dataset when that is a ``maestro.data.JsonlDataset`` (same options, same ``collate``). Any
other job supplies its eval records itself: ``Job(..., eval_dataset=records)`` (any
map-style dataset of records, read with the job's ``collate``)::

    def job(config):
        return Job(sections, dataset=train_records, eval_dataset=eval_records)

``[eval] data`` overrides ``eval_dataset`` for a ``JsonlDataset`` job. The records are read in
file order in global batches of ``global_batch`` records (the last one partial, not dropped),
at most ``[eval] batches`` of them; sample ids restart at 0 in each batch, as in training.

Every rank runs the eval batches through the run's own layout and scheduler, forward only
(``MaestroWorker.evaluate``, ``MonolithicWorker.evaluate``): no gradient, no optimizer step,
modules in ``eval()`` mode for the pass (their training flags restored after), so a run with
``[eval]`` trains exactly like one without. The reported eval loss is the sinks' per-sample
losses summed over every eval batch divided by the sum of the batches' normalisers (the job's
``normaliser``), i.e. ``total loss / total normaliser``; other per-sample scalars a sink
returns (``ce``, ``kl``, ...) are summed and divided the same way.

Logs (``MetricsLog``, rank 0 only): ``metrics.jsonl`` (one JSON object per line) and
TensorBoard event files whose scalar tags are the rows' keys (all but ``step``). Both series
share one x axis in TensorBoard: optimizer steps done (``steps_done``), so a training row is
plotted at ``step + 1`` and an eval row at its ``step``; the eval after 5 steps and the 5th
step's training loss sit at x = 5. A training row (``step``: the 0-based step, as
``result["losses"][step]``) has

- ``loss``: the step's loss; ``loss/SECTION``: each sink section's share of it;
- ``lr/SECTION``: each trainable section's learning rate at the step;
- ``samples_per_s``: global batch over the wall time since the previous row;
- ``busy/SECTION``: the section's busy fraction since the timed window began (as the
  progress bar);
- ``peak_mem_bytes/SECTION``: the largest peak memory of the section's ranks
  (``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU);
- ``skipped``: 1 when ``--on-nonfinite skip`` dropped the step's update, else 0.

An eval row (``step``: optimizer steps done, i.e. the weights training step ``step`` starts
from) has ``eval/loss``, ``eval/loss/SECTION`` (per sink section), ``eval/KEY`` (each other
per-sample scalar of the sinks), ``eval/samples``, ``eval/normaliser`` and ``eval/seconds``.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from maestro.job import eval_dataset  # the job API finds the records (config validates too)

#: eval batch ``b`` travels as virtual step ``EVAL_STEP_BASE + b`` (its own message tags and
#: batch fingerprint, never a training step's)
EVAL_STEP_BASE = 1 << 28

#: the non-scalar-tag keys of a row
ROW_KEYS = ("step",)


def num_eval_batches(dataset, config) -> int:
    """Eval global batches: ``ceil(len / global_batch)``, at most ``eval.batches``."""
    n = math.ceil(len(dataset) / config.global_batch)
    cap = config.eval.batches
    return n if cap is None else min(n, cap)


def eval_batches(job, config):
    """The eval global batches, built one at a time (samples with ``"id"`` 0..n-1)."""
    ds = eval_dataset(job, config)
    B = config.global_batch
    for b in range(num_eval_batches(ds, config)):
        out = []
        for i, pos in enumerate(range(b * B, min(len(ds), (b + 1) * B))):
            s = job.collate(ds[pos])
            if not isinstance(s, dict):
                raise ValueError(f"eval batch {b}: sample {i} is a {type(s).__name__}, not a dict")
            out.append({**s, "id": i})
        yield out


@contextmanager
def eval_mode(modules):
    """Every module (and submodule) in ``eval()`` mode, each one's training flag restored."""
    seen: dict[int, Any] = {}
    for top in modules:
        for m in top.modules():
            seen.setdefault(id(m), (m, m.training))
    try:
        for m, _ in seen.values():
            m.training = False
        yield
    finally:
        for m, flag in seen.values():
            m.training = flag


@contextmanager
def gathered_through_eval(modules):
    """FSDP2 units keep their parameters gathered from their first eval forward to the end
    of the pass (``reshard`` frees them), each unit's own setting restored after.

    Why: a user's forward may call the module once per sample, so the shard group's ranks
    can make different numbers of calls for micro-batches of different sizes (a partial
    held-out batch: 2 samples on one rank, 1 on its peer). A unit that reshards after every
    call all-gathers on every call, and the ranks' collectives fall out of step (a hang).
    Gathered once, later calls need no collective; every rank still runs each unit at least
    once per micro-batch (padding included), so the one all-gather stays in step."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        yield
        return
    units = [m for top in modules for m in top.modules() if isinstance(m, FSDPModule)]
    before = []
    for m in units:
        groups = m._get_fsdp_state()._fsdp_param_groups  # private: FSDP2 has no getter
        before.append(any(g.post_forward_mesh_info is not None for g in groups))
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, flag in zip(units, before):
            m.set_reshard_after_forward(flag, recurse=False)


def reshard(modules) -> None:
    """Free FSDP2's gathered parameters a forward without backward may keep (local, no
    collective): training starts from sharded parameters again."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return
    for top in modules:
        for m in top.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _scalar(v) -> float | None:
    import torch

    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype != torch.bool:
        if v.is_complex():
            return None
        return float(v.detach().reshape(()).item())
    return None


def add_sink_outputs(sums: dict[str, float], section: str, outs) -> None:
    """Add a sink micro-batch's per-sample ``loss`` (total and ``loss/SECTION``) and its
    other per-sample scalars to ``sums``."""
    from maestro.runtime.failures import sink_loss

    for o in outs:
        loss = float(sink_loss(section, o))
        sums["loss"] = sums.get("loss", 0.0) + loss
        sums[f"loss/{section}"] = sums.get(f"loss/{section}", 0.0) + loss
        for k, v in o.items():
            if k == "loss":
                continue
            x = _scalar(v)
            if x is not None:
                sums[k] = sums.get(k, 0.0) + x


def eval_row(step: int, per_rank: list[dict[str, float]], norm: float, samples: int, seconds):
    """Rank 0's eval row from every rank's sums (``add_sink_outputs``)."""
    total: dict[str, float] = {}
    for sums in per_rank:
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + v
    row: dict[str, Any] = {"step": step, "eval/loss": total.pop("loss", 0.0) / norm}
    for k in sorted(total):
        row[f"eval/{k}"] = total[k] / norm
    row.update({"eval/samples": samples, "eval/normaliser": norm, "eval/seconds": seconds})
    return row


def peak_memory_bytes(device) -> float:
    """This process's peak memory: ``max_memory_allocated`` on CUDA, peak RSS on CPU."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(rss if sys.platform == "darwin" else rss * 1024)
    except (ImportError, OSError):  # pragma: no cover - not POSIX
        return 0.0


def check_tensorboard() -> None:
    """``ValueError`` when TensorBoard's writer cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"--log-dir: writing TensorBoard event files needs the tensorboard package ({e}); "
            "pip install tensorboard"
        ) from None


def steps_done(row: dict[str, Any]) -> int:
    """The TensorBoard x of a row: optimizer steps done. A training row's ``step`` is the
    0-based step, whose update makes ``step + 1`` steps done; an eval row's ``step`` already
    counts the steps done. So the eval after 5 steps sits at x = 5 with the 5th step's loss
    (0-based step 4), not one step off."""
    is_eval = any(k.startswith("eval/") for k in row)
    return int(row["step"]) if is_eval else int(row["step"]) + 1


class MetricsLog:
    """Rank 0's run log: ``DIR/metrics.jsonl`` (appended) and TensorBoard event files."""

    def __init__(self, log_dir: str | Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.file = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        """One row: a line of ``metrics.jsonl`` and a scalar per key (but ``step``), plotted
        at the optimizer steps done (``steps_done``): one axis for training and eval."""
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        x = steps_done(row)
        for k, v in row.items():
            if k in ROW_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            self.writer.add_scalar(k, v, global_step=x)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
        self.file.close()
