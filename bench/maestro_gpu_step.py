"""The cost model against a real GPU: measured training steps and attention beside
``maestro estimate``'s prediction for the same shapes, on the lent accelerator.

Every plan Maestro and its baselines are priced with rests on the per-GPU kernel model
(``maestro.estimate.kernels``): GEMMs, flash attention, elementwise work, the optimizer step.
This runs the same decoder shapes for real (plain PyTorch eager: bf16 autocast over fp32
weights, SDPA causal attention, SwiGLU, fused AdamW, no recompute: what one torchtitan rank
runs without its collectives) and prints, per row, the measured step, the predicted one and
their ratio. A second table times SDPA's causal forward at long sequences beside the kernel
model's ``attn_fwd``, the figure context parallelism's K/V ring is hidden under
(``maestro.estimate.pipeline.cp_ring_exposed``).

    python bench/maestro_gpu_step.py --device cuda --out $OUT      # on the lent GPU
    python bench/maestro_gpu_step.py --device cpu --quick           # a smoke run here

One GPU cannot show collectives (FSDP, TP, PP sends, the CP ring): those stay priced from
their cited bandwidths. Nothing is fitted to these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

#: (name, layers, hidden, heads, ffn, vocab): Llama-style decoders of ~1.2B and ~3.1B
SHAPES = {
    "1b": (16, 2048, 16, 5632, 32000),
    "3b": (26, 3072, 24, 8192, 32000),
    "tiny": (2, 128, 4, 256, 512),
}
#: (shape, sequence, micro-batch) rows of the step table
STEP_ROWS = [("1b", 4096, 1), ("1b", 4096, 4), ("1b", 16384, 1), ("3b", 4096, 2)]
#: sequences of the attention table (one layer of the 1b shape, batch 1)
ATTN_SEQS = [8192, 16384, 32768]


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.n1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.n2 = nn.RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):  # x: (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # ids: (B, T) -> loss
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(shape: str, seq: int, mbs: int, device, steps: int, warmup: int) -> float:
    """Seconds of one training step (forward, backward, AdamW) at ``mbs x seq`` tokens."""
    torch.manual_seed(0)
    model = Decoder(*SHAPES[shape]).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    ids = torch.randint(0, SHAPES[shape][4], (mbs, seq), device=device)
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device.type, dtype=dtype):
            loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def measure_attention(seq: int, device, reps: int) -> float:
    """Seconds of one causal SDPA forward of the 1b shape's layer at batch 1 (bf16)."""
    _, hidden, heads, _, _ = SHAPES["1b"]
    d = hidden // heads
    q, k, v = (torch.randn(1, heads, seq, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sync(device)
    return (time.perf_counter() - t0) / reps


def spec_of(shape: str):
    from maestro.estimate import ModelSpec

    layers, hidden, heads, ffn, vocab = SHAPES[shape]
    return ModelSpec(shape, layers, hidden, heads, heads, ffn, vocab, gated=True)


def predicted_step(shape: str, seq: int, mbs: int, hw: str) -> float:
    from maestro.estimate import estimate

    return estimate(
        spec_of(shape),
        gpus=1,
        seq_len=seq,
        micro_batch=mbs,
        recompute="none",
        hardware_name=hw,
    ).step_time


def predicted_attention(seq: int, hw: str) -> float:
    from maestro.estimate import framework, hardware
    from maestro.estimate.kernels import attention_pairs, layer_cost

    spec = spec_of("1b")
    fw = framework("torchtitan")
    pairs = attention_pairs([float(seq)], seq, True)
    lc = layer_cost(
        spec, float(seq), pairs, float(seq), 1, "none", hardware(hw), fw.kernels,
        fw.kernel_efficiency,
    )  # fmt: skip
    return lc.attn_fwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hardware", default="h200", help="the estimate's preset for the device")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--out", default=None, help="folder for results.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; estimate preset: {args.hardware}; torch {torch.__version__}")
    rows = [("tiny", 256, 2)] if args.quick else STEP_ROWS
    seqs = [512] if args.quick else ATTN_SEQS
    steps, warmup = (1, 1) if args.quick else (8, 3)
    out = {"device": name, "hardware": args.hardware, "steps": [], "attention": []}
    print(f"{'shape':<6}{'seq':>7}{'mbs':>5}{'measured s':>12}{'predicted s':>13}{'ratio':>8}")
    for shape, seq, mbs in rows:
        try:
            got = measure_step(shape, seq, mbs, device, steps, warmup)
        except torch.OutOfMemoryError:
            print(f"{shape:<6}{seq:>7}{mbs:>5}  out of memory")
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous row's model and optimizer are gone
        pred = predicted_step(shape, seq, mbs, args.hardware)
        print(f"{shape:<6}{seq:>7}{mbs:>5}{got:>12.4f}{pred:>13.4f}{got / pred:>8.2f}")
        out["steps"].append(dict(shape=shape, seq=seq, mbs=mbs, measured=got, predicted=pred))
    print(f"\n{'attention seq':<14}{'measured ms':>12}{'predicted ms':>14}{'ratio':>8}")
    for seq in seqs:
        got = measure_attention(seq, device, 3 if args.quick else 20)
        pred = predicted_attention(seq, args.hardware)
        print(f"{seq:<14}{1e3 * got:>12.3f}{1e3 * pred:>14.3f}{got / pred:>8.2f}")
        out["attention"].append(dict(seq=seq, measured=got, predicted=pred))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "maestro_gpu_step.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
