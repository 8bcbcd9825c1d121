"""Per-section parallel strategies on 4 ranks: step time, per-rank memory, exactness.

For a KD job (frozen teacher + trained student, the project's own transformer blocks) this
runs, in one invocation, the same 4-rank budget under hand-written layouts that each use one
strategy for the student (and some for the teacher): plain replicas, FSDP, tensor parallel,
ZeRO-1, activation recompute, and mixes. Per layout it prints

- the step time (float32, one intra-op thread per rank, steps after the first),
- the student's per-rank bytes of parameters + gradients + optimizer state (what FSDP and
  ZeRO shard), as a ratio to the replicated layout's,
- the largest relative difference of the loss curve to one process running the whole model
  (``reference_train``) in float64 over 3 steps: each strategy changes the arithmetic's order
  only.

With ``--plan`` it also asks ``maestro plan`` for a 4-rank layout of the same job and runs it
beside the hand-written ones. Benchmarks are never tests.

``--cp`` measures context parallelism instead: per-rank peak memory of one causal attention
layer's forward and backward (queries, keys, values of one 4-head, 32-wide layer, float32) at
4k, 8k and 16k tokens, as ``cp = 1, 2, 4`` gloo ranks running ``maestro.parallel.cp``'s ring
attention, beside torch's fused SDPA in one process. Peak memory is the growth of the
process's resident high-water mark (``ru_maxrss``) over the step, each measurement in a fresh
process; the largest rank's is reported.

    .venv/bin/python bench/maestro_parallel.py            # ~5 minutes on 2 cores
    .venv/bin/python bench/maestro_parallel.py --quick    # fewer steps and layouts
    .venv/bin/python bench/maestro_parallel.py --cp       # ~4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys  # noqa: E402
import time
from pathlib import Path  # noqa: E402

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.runtime.local import reference_train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model as _cpu_model  # noqa: E402

BASE = """
global_batch = 16
steps = {steps}
seed = 0
dtype = "{dtype}"
scheduler = "wavefront"
threads = 1
[workload]
name = "kd"
vocab_size = 256
seq_len_min = 16
seq_len_max = 64
teacher_dim = 128
teacher_layers = 4
student_dim = 64
student_layers = 4
heads = 4
[sections.teacher]
frozen = true
micro_batch_size = 8
{teacher}
[sections.student]
micro_batch_size = 2
lr = 1e-3
{student}
"""

#: name -> (teacher fields, student fields); every layout uses 4 ranks
LAYOUTS = {
    "replicas (teacher dp=1, student dp=3)": ("dp = 1", "dp = 3"),
    "student fsdp=3": ("dp = 1", "dp = 1\nfsdp = 3"),
    "student zero=1 (dp=3)": ("dp = 1", "dp = 3\nzero = 1"),
    "student recompute (dp=3)": ("dp = 1", "dp = 3\nrecompute = true"),
    "teacher tp=2, student dp=2": ("tp = 2", "dp = 2"),
    "teacher tp=2, student fsdp=2": ("tp = 2", "dp = 1\nfsdp = 2"),
    "teacher dp=2, student tp=2": ("dp = 2", "dp = 1\ntp = 2"),
}
QUICK = ["replicas (teacher dp=1, student dp=3)", "student fsdp=3", "teacher tp=2, student fsdp=2"]


def config(teacher: str, student: str, steps: int, dtype: str) -> C.TrainConfig:
    return C.loads(BASE.format(teacher=teacher, student=student, steps=steps, dtype=dtype))


def student_bytes(result: dict) -> float:
    """Mean per-rank state bytes of the student's ranks."""
    rows = [r for r in result.get("state_bytes", []) if r["label"].startswith("student")]
    return sum(r.get("total", 0) for r in rows) / max(len(rows), 1)


def run_layout(name: str, teacher: str, student: str, steps: int) -> dict:
    exact = config(teacher, student, 3, "float64")
    got = launch(exact, opts=RunOptions(progress=False), timeout_s=900)["losses"]
    _, want = reference_train(exact)
    diff = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    timed = config(teacher, student, steps, "float32")
    t0 = time.perf_counter()
    res = launch(timed, opts=RunOptions(progress=False), timeout_s=900)
    wall = time.perf_counter() - t0
    step = res["elapsed_s"] / max(res["measured_steps"], 1)
    return {"name": name, "step_s": step, "bytes": student_bytes(res), "diff": diff, "wall": wall}


def _cp_rank(rank: int, world: int, tokens: int, fused: bool, port: int, queue) -> None:
    """One rank of a ``--cp`` measurement: its ``(rank, peak bytes, seconds)`` on ``queue``."""
    import os
    import resource

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from maestro.parallel import cp as CP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    heads, width = 4, 32
    samples = [{"tokens": torch.arange(tokens)}]
    chunks, _, rows = CP.split_micro_batch(samples, {}, world, rank, "bench")
    if fused:  # torch's own kernel on the whole sequence, one process
        shape, rows = (1, heads, tokens, width), None
    else:  # this rank's head and tail chunk samples, right-padded
        shape = (2, heads, max(c["tokens"].numel() for c in chunks), width)
    g = torch.Generator().manual_seed(rank)
    qkv = [torch.randn(*shape, generator=g, requires_grad=True) for _ in range(3)]
    ctx = CP.CPContext(dist.group.WORLD, world, rank, rows, "bench", ranks=list(range(world)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if fused:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    else:
        with CP.active(ctx):
            out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    out.sum().backward()
    seconds = time.perf_counter() - t0
    queue.put((rank, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, seconds))
    dist.destroy_process_group()


def cp_rows() -> int:
    """The ``--cp`` table (see the module docstring)."""
    import torch.multiprocessing as mp

    from maestro.runtime.launch import free_port

    print(
        f"context parallelism: one causal attention layer (4 heads x 32, float32), fwd+bwd, "
        f"peak RSS growth per rank (largest rank); CPU: {_cpu_model()}"
    )
    print(f"\n{'tokens':>7}{'layout':>30}{'peak MiB/rank':>15}{'vs cp=1':>9}{'seconds':>9}")
    for tokens in (4096, 8192, 16384):
        base = None
        for name, world, fused in (
            ("torch SDPA (fused), 1 rank", 1, True),
            ("ring cp=1", 1, False),
            ("ring cp=2", 2, False),
            ("ring cp=4", 4, False),
        ):
            ctx = mp.get_context("spawn")
            queue = ctx.SimpleQueue()
            args = (world, tokens, fused, free_port(), queue)
            mp.start_processes(_cp_rank, args=args, nprocs=world, start_method="spawn")
            got = [queue.get() for _ in range(world)]
            peak = max(b for _, b, _ in got) / 2**20
            secs = max(s for _, _, s in got)
            if name == "ring cp=1":
                base = peak
            rel = f"{peak / base:>8.2f}x" if base else f"{'':>9}"
            print(f"{tokens:>7}{name:>30}{peak:>15.1f}{rel}{secs:>9.2f}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed steps per layout (first: warm-up)")
    p.add_argument("--quick", action="store_true", help="3 layouts, 4 steps")
    p.add_argument(
        "--cp", action="store_true", help="context parallelism's attention memory rows only"
    )
    args = p.parse_args()
    if args.cp:
        return cp_rows()
    steps = 4 if args.quick else args.steps
    names = QUICK if args.quick else list(LAYOUTS)
    cpu = _cpu_model()
    print(f"maestro parallel strategies, KD on 4 ranks x 1 thread, {steps} steps; CPU: {cpu}")
    rows = []
    for name in names:
        teacher, student = LAYOUTS[name]
        rows.append(run_layout(name, teacher, student, steps))
        r = rows[-1]
        print(f"  ran {name}: {r['step_s']:.3f} s/step ({r['wall']:.0f} s wall)", flush=True)
    base = rows[0]
    print(
        f"\n{'layout':<34}{'s/step':>9}{'vs replicas':>13}{'student B/rank':>16}"
        f"{'vs replicas':>13}{'max rel diff':>14}"
    )
    for r in rows:
        print(
            f"{r['name']:<34}{r['step_s']:>9.3f}{r['step_s'] / base['step_s']:>12.2f}x"
            f"{r['bytes']:>16,.0f}{r['bytes'] / max(base['bytes'], 1):>12.2f}x{r['diff']:>14.1e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
