"""Published GPU training runs the cost model is checked against.

Each ``Run`` is one published row: its model, layout, batch and recompute as the source
states them, and the throughput (tokens/s per GPU) and memory it reports. ``fit=True`` marks
the one row ``framework.KERNEL_EFFICIENCY`` was fitted on; all others are tests.

Sources:
- torchtitan docs/performance.md (commit eaea6f6), "Grand Teton" H100 96 GB HBM2e at 500 W:
  Table 1 (Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, sequence 8192, selective AC) and
  Table 3 (the same on 128 GPUs), without and with ``torch.compile``; and its older revision
  (commit 0413364): Llama 3 8B and 70B on 64 A100 80 GB (reported only: that cluster's network
  is not published).
- Megatron-LM README, images/model_table.png ("Megatron-Core r0.8.0" weak scaling, H100,
  vocabulary 131,072, sequence 4096, data-parallel 48): per-GPU model TFLOP/s of GPT models
  from 1.7B to 462B. The table gives TP, PP, GPUs and batch, not the micro-batch size or the
  pipeline schedule: rows are estimated at the best micro-batch of 1, 2 and 4 that fits
  (``best_micro_batch``) with plain 1F1B, and the pipelined rows are reported, not tested.
"""

from __future__ import annotations

from dataclasses import dataclass

from maestro.estimate.framework import Framework, framework
from maestro.estimate.models import ModelSpec, gpt
from maestro.estimate.step import Estimate, estimate


@dataclass(frozen=True)
class Run:
    """One published run.

    Args:
        name: label.
        model: preset name or spec.
        gpus, seq_len, micro_batch, global_batch, tp, pp, recompute: as published
            (``micro_batch = 0``: not published; the best of 1, 2, 4 that fits).
        hardware, framework: the presets standing for the run's machine and software.
        tokens_per_s: published tokens/s per GPU (derived from TFLOP/s for Megatron-LM).
        memory_gib: published peak memory per GPU (None: not published).
        fit: the row ``KERNEL_EFFICIENCY`` was fitted on.
        tested: ``tests/maestro/test_estimate_calibration.py`` asserts 15% on it.
    """

    name: str
    model: str | ModelSpec
    gpus: int
    seq_len: int
    micro_batch: int
    global_batch: int | None
    tp: int
    pp: int
    recompute: str
    hardware: str
    framework: str
    tokens_per_s: float
    memory_gib: float | None = None
    fit: bool = False
    tested: bool = True


def _megatron(size, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> Run:
    spec = gpt(f"gpt-{size}", layers, hidden, heads)
    from maestro.estimate.step import model_flops_per_token

    tps = tflops * 1e12 / model_flops_per_token(spec, 4096)
    return Run(
        f"Megatron-LM GPT {size}, {gpus} H100 (tp {tp}, pp {pp})",
        spec,
        gpus,
        4096,
        0,
        batch,
        tp,
        pp,
        "none",
        "h100-sxm",
        "megatron",
        tps,
        tested=pp == 1,
    )


_TT = dict(seq_len=8192, micro_batch=2, global_batch=None, tp=1, pp=1, recompute="selective")
PUBLISHED: list[Run] = [
    Run(
        "torchtitan Llama 3.1 8B, 8 H100, FSDP",
        "llama3-8b",
        8,
        hardware="h100-96g-500w",
        framework="torchtitan",
        tokens_per_s=5762,
        memory_gib=82.4,
        fit=True,
        **_TT,
    ),
    Run(
        "torchtitan Llama 3.1 8B, 128 H100, FSDP",
        "llama3-8b",
        128,
        hardware="h100-96g-500w",
        framework="torchtitan",
        tokens_per_s=5605,
        memory_gib=67.0,
        **_TT,
    ),
    Run(
        "torchtitan Llama 3.1 8B, 8 H100, FSDP + compile",
        "llama3-8b",
        8,
        hardware="h100-96g-500w",
        framework="torchtitan-compile",
        tokens_per_s=6667,
        memory_gib=77.0,
        **_TT,
    ),
    Run(
        "torchtitan Llama 3.1 8B, 128 H100, FSDP + compile",
        "llama3-8b",
        128,
        hardware="h100-96g-500w",
        framework="torchtitan-compile",
        tokens_per_s=6514,
        memory_gib=62.0,
        **_TT,
    ),
    # torchtitan docs/performance.md, older revision (commit 0413364): Llama 3 on 64 A100
    # 80 GB, FSDP, local batch 1, sequence 8192; the network is not published: reported only
    Run(
        "torchtitan Llama 3 8B, 64 A100, FSDP, op AC",
        "llama3-8b",
        64,
        8192,
        1,
        None,
        1,
        1,
        "selective",
        "a100-80g",
        "torchtitan",
        2973,
        tested=False,
    ),
    Run(
        "torchtitan Llama 3 70B, 64 A100, FSDP, full AC",
        "llama3-70b",
        64,
        8192,
        1,
        None,
        1,
        1,
        "full",
        "a100-80g",
        "torchtitan",
        331,
        tested=False,
    ),
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _megatron("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _megatron("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _megatron("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _megatron("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _megatron("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def run(row: Run, fw: Framework | None = None) -> Estimate:
    """``estimate`` of ``row`` (``fw``: a framework to use instead of the row's)."""
    kw = dict(
        gpus=row.gpus,
        seq_len=row.seq_len,
        global_batch=row.global_batch,
        tp=row.tp,
        pp=row.pp,
        recompute=row.recompute,
        hardware_name=row.hardware,
        framework_name=fw or framework(row.framework),
    )
    if row.micro_batch:
        return estimate(row.model, micro_batch=row.micro_batch, **kw)
    return best_micro_batch(row.model, **kw)


def best_micro_batch(model, sizes=(1, 2, 4), **kw) -> Estimate:
    """The fastest estimate over micro-batch ``sizes`` that fits (else the smallest)."""
    got = []
    for mbs in sizes:
        try:
            got.append(estimate(model, micro_batch=mbs, **kw))
        except ValueError:
            continue
    if not got:
        raise ValueError("no micro-batch size divides the global batch")
    fitting = [e for e in got if e.fits] or got[:1]
    return max(fitting, key=lambda e: e.tokens_per_s_per_gpu)


def compare() -> list[dict]:
    """Every published row beside its estimate."""
    out = []
    for row in PUBLISHED:
        e = run(row)
        out.append(
            {
                "run": row.name,
                "role": "fit" if row.fit else ("test" if row.tested else "reported"),
                "published_tps": row.tokens_per_s,
                "estimated_tps": e.tokens_per_s_per_gpu,
                "tps_error": e.tokens_per_s_per_gpu / row.tokens_per_s - 1.0,
                "published_gib": row.memory_gib,
                "estimated_gib": e.peak_memory / 2**30,
                "gib_error": (
                    e.peak_memory / 2**30 / row.memory_gib - 1.0 if row.memory_gib else None
                ),
                "mfu": e.mfu,
                "micro_batch": e.tokens_per_step
                / e.layout.data_parallel
                / e.micro_batches
                / row.seq_len,
            }
        )
    return out


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'published run':<52}{'role':>9}{'tok/s pub':>11}{'est':>8}{'err':>8}"
        f"{'GiB pub':>9}{'est':>7}{'err':>8}{'MFU':>7}"
    ]
    for r in rows:
        gib = (
            f"{r['published_gib']:>9.1f}{r['estimated_gib']:>7.1f}{100 * r['gib_error']:>+7.1f}%"
            if r["published_gib"]
            else f"{'-':>9}{r['estimated_gib']:>7.1f}{'':>8}"
        )
        lines.append(
            f"{r['run']:<52}{r['role']:>9}{r['published_tps']:>11.0f}{r['estimated_tps']:>8.0f}"
            f"{100 * r['tps_error']:>+7.1f}%{gib}{100 * r['mfu']:>6.1f}%"
        )
    return "\n".join(lines)
