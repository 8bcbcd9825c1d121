"""Seconds and bytes of one transformer's kernels on one GPU: GEMMs by their shapes, flash
attention by its lengths, the memory-bound elementwise ops by the bytes they move, and the
activations each recompute policy keeps.

Everything here is per GPU: tensor parallelism enters as the per-GPU matrix widths
(``hidden / tp``, ``ffn / tp``), context parallelism as the per-GPU token count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from maestro.estimate.hardware import Hardware
from maestro.estimate.models import ModelSpec

#: Output tile of one Hopper/Ampere cuBLAS bf16 GEMM thread block (the largest common CUTLASS
#: tile; NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background": tile and
#: wave quantization). A GEMM runs ``ceil(tiles / SMs)`` waves; the last wave's idle SMs and
#: the padded edge tiles are lost.
TILE_M, TILE_N = 128, 256
#: K-loop depth lost per tile to the software pipeline's fill and the epilogue, in elements of
#: K (assumed: about four 64-wide K stages, the depth of a Hopper/Ampere multistage
#: mainloop): a tile's efficiency is ``K / (K + GEMM_K_OVERHEAD)``. The MAMF ceiling is
#: measured at K >= 4096, where this costs under 6%.
GEMM_K_OVERHEAD = 256.0

#: Flash attention's best fraction of the bf16 peak, forward and backward. H100/H200:
#: FlashAttention-3 paper (Shah et al. 2024) abstract: FlashAttention-2 (what PyTorch SDPA
#: runs) "achieving only 35% utilization on the H100"; A100: FlashAttention-2 paper (Dao 2023)
#: "up to 73% of the theoretical maximum FLOPs/s" forward, "up to 63%" backward. The H100
#: backward takes the A100's backward/forward ratio (63/73).
ATTN_EFF = {"a100": (0.73, 0.63), "default": (0.35, 0.35 * 63 / 73)}
#: sequence length at which flash attention reaches half its best rate (assumed from the
#: shape of FlashAttention-2 paper figure 4: at 512 tokens about 2/3 of the 16k rate).
ATTN_HALF_LEN = 256.0
#: FlashAttention-2 paper: the backward pass runs 5 matmuls to the forward's 2 (2.5x FLOPs).
ATTN_BWD_FLOPS = 2.5


def gemm_time(m: float, n: float, k: float, hw: Hardware, eff: float) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` bf16 GEMM.

    The larger of its compute (``2 m n k`` at the MAMF ceiling times ``eff``, less tile and
    wave quantization and the K-loop's fill) and its memory traffic (reading both operands,
    writing the output), plus one launch.
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    # a pure function of its shape: memoised per Hardware instance (the planner prices the
    # same per-GPU shapes millions of times; a dict lookup is ~10x cheaper than the formula)
    cache = hw.__dict__.get("_gemm_memo")
    if cache is None:
        cache = {}
        object.__setattr__(hw, "_gemm_memo", cache)  # frozen: not a field, eq/hash unchanged
    key = (m, n, k, eff)
    got = cache.get(key)
    if got is None:
        if len(cache) > 1 << 20:  # bounded: ~150 MB at most
            cache.clear()
        got = cache[key] = _gemm_time(m, n, k, hw, eff)
    return got


def _gemm_time(m: float, n: float, k: float, hw: Hardware, eff: float) -> float:
    # cuBLAS picks smaller tiles for skinny shapes and splits K when the tiles cannot fill
    # the SMs; what stays lost is the padded edge of the tiles and the last wave's idle SMs
    tm = min(TILE_M, 2 ** math.ceil(math.log2(max(m, 16))))
    tn = min(TILE_N, 2 ** math.ceil(math.log2(max(n, 16))))
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    split = max(1, min(hw.sms // tiles, int(k // GEMM_K_OVERHEAD))) if tiles < hw.sms else 1
    work = tiles * split
    waves = math.ceil(work / hw.sms)
    kk = k / split
    quant = (m * n) / (tiles * tm * tn) * work / (waves * hw.sms) * kk / (kk + GEMM_K_OVERHEAD)
    compute = 2.0 * m * n * k / (hw.gemm_peak * eff * quant)
    memory = 2.0 * (m * k + k * n + m * n) / (hw.hbm_bw * hw.hbm_eff)
    return max(compute, memory) + hw.kernel_launch


def linear_times(tokens: float, n_out: float, k_in: float, hw: Hardware, eff: float):
    """``(forward, backward)`` seconds of a linear layer ``(tokens, k_in) -> (tokens, n_out)``:
    the forward GEMM; the backward's input-gradient and weight-gradient GEMMs."""
    fwd = gemm_time(tokens, n_out, k_in, hw, eff)
    bwd = gemm_time(tokens, k_in, n_out, hw, eff) + gemm_time(n_out, k_in, tokens, hw, eff)
    return fwd, bwd


def attention_pairs(lengths: list[float] | None, tokens: float, causal: bool) -> float:
    """Query-key pairs one micro-batch's attention computes: ``sum s^2 / 2`` (causal, plus the
    diagonal) or ``sum s^2``; ``lengths`` the samples' lengths (default: one of ``tokens``)."""
    ls = lengths if lengths else [tokens]
    sq = sum(s * s for s in ls)
    return (sq + sum(ls)) / 2.0 if causal else sq


def attention_times(
    spec: ModelSpec,
    pairs: float,
    mean_len: float,
    heads_per_gpu: float,
    hw: Hardware,
    eff: float,
) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one layer's flash attention over ``pairs`` query-key
    pairs on one GPU (``heads_per_gpu`` heads)."""
    if pairs <= 0:
        return 0.0, 0.0
    f_eff, b_eff = ATTN_EFF.get(hw.name.split("-")[0], ATTN_EFF["default"])
    sat = mean_len / (mean_len + ATTN_HALF_LEN)
    flops = 4.0 * pairs * spec.dh * heads_per_gpu
    fwd = flops / (hw.flops * f_eff * sat * eff) + hw.kernel_launch
    bwd = ATTN_BWD_FLOPS * flops / (hw.flops * b_eff * sat * eff) + hw.kernel_launch
    return fwd, bwd


@dataclass(frozen=True)
class Kernels:
    """How a training framework runs a block's non-GEMM work (``framework.Framework``).

    Args:
        fused: norms, rotary, activation and residual adds are fused kernels (Megatron's
            Transformer Engine, ``torch.compile``); ``False``: PyTorch eager, one kernel per
            op, RMSNorm and rotary computed in fp32 (torchtitan's model code).
        ce_bytes: bytes moved per logit element by the loss, forward and backward.
        logit_bytes: bytes per logit element alive at the loss (logits, fp32 copies).
    """

    fused: bool
    ce_bytes: float
    logit_bytes: float


def elementwise_bytes(spec: ModelSpec, k: Kernels) -> float:
    """HBM bytes per token of one block's forward outside GEMMs and attention.

    Counted from the ops (bf16 = 2 bytes, fp32 = 4): eager RMSNorm (``x.float()``, ``pow``,
    ``mean``, ``* rsqrt``, ``type_as``, ``* weight``: 36 bytes per element), eager rotary (fp32
    complex multiply: 20 per element of q and k), GQA's ``repeat_kv`` copy (k and v to every
    head), SwiGLU's ``silu`` and ``*`` (10 per element of ``f``) or GeLU (4), two residual adds
    (6 per element each). Fused: one read and one write per norm, rotary and activation;
    residual adds read two and write one.
    """
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn
    if k.fused:
        act = 6 * f if spec.gated else 4 * f
        rope = 4 * q + 4 * kv if spec.causal else 0
        return 2 * 4 * h + rope + act + 2 * 6 * h
    act = 10 * f if spec.gated else 4 * f
    rope = 20 * q + 20 * kv if spec.causal else 0
    repeat = 4 * q + 4 * kv if spec.kv_heads != spec.heads else 0
    return 2 * 36 * h + rope + repeat + act + 2 * 6 * h


#: recompute policies (``--recompute``)
RECOMPUTE = ("none", "selective", "full")


def activation_bytes(spec: ModelSpec, policy: str, k: Kernels) -> float:
    """Bytes per token one block keeps for its backward under ``policy``.

    - ``none``: every saved tensor: the two norms' inputs and outputs, q/k/v after rotary,
      the attention output, the MLP's inputs and intermediates (eager RMSNorm also keeps its
      fp32 input, 4 bytes per element, for each norm).
    - ``selective``: torchtitan's op-level policy: the block input, the outputs of every
      other matmul (q, v, the MLP's first and second projections) and of attention; the rest
      is recomputed.
    - ``full``: the block input only.
    """
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn
    if policy == "full":
        return 2.0 * h
    if policy == "selective":
        return 2 * h + 2 * q + 2 * kv + 2 * f + 2 * h + 2 * q
    mlp = 8 * f if spec.gated else 4 * f
    extra = 0 if k.fused else 2 * 4 * h
    return 4 * h + 4 * h + 2 * q + 4 * kv + 2 * q + mlp + extra


@dataclass
class LayerCost:
    """Seconds of one block on one GPU for one micro-batch (compute only; collectives apart).

    ``recompute``: what the policy repeats in the backward (already inside ``bwd``)."""

    fwd: float
    bwd: float
    recompute: float
    gemm_fwd: float
    attn_fwd: float
    elem_fwd: float


def layer_cost(
    spec: ModelSpec,
    tokens: float,
    pairs: float,
    mean_len: float,
    tp: int,
    policy: str,
    hw: Hardware,
    k: Kernels,
    eff: float,
) -> LayerCost:
    """One block's forward and backward (with recompute) on one GPU of a ``tp`` group.

    Args:
        tokens: positions of the micro-batch on this GPU (sequence parallel: every GEMM
            sees all of them after the all-gather).
        pairs: attention query-key pairs on this GPU (``attention_pairs``, over ``cp``).
        mean_len: mean sample length (flash attention's efficiency).
        tp: tensor-parallel degree (heads and MLP width split ``tp`` ways).
        policy: ``none`` | ``selective`` | ``full``.
        eff: the framework's kernel efficiency on the MAMF and attention ceilings.
    """
    if policy not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {policy!r}")
    h = spec.hidden
    mlp_out = (2 if spec.gated else 1) * spec.ffn / tp
    shapes = [  # (name, n_out, k_in) per GPU
        ("q", spec.q_dim / tp, h),
        ("k", spec.kv_dim / tp, h),
        ("v", spec.kv_dim / tp, h),
        ("o", h, spec.q_dim / tp),
        ("up", mlp_out, h),
        ("down", h, spec.ffn / tp),
    ]
    g = {name: linear_times(tokens, n, kk, hw, eff) for name, n, kk in shapes}
    gemm_f = sum(v[0] for v in g.values())
    gemm_b = sum(v[1] for v in g.values())
    attn_f, attn_b = attention_times(spec, pairs, mean_len, spec.heads / tp, hw, eff)
    # elementwise bytes scale with the per-GPU widths (sequence parallel shards the rest)
    elem_f = elementwise_bytes(spec, k) * tokens / tp / (hw.hbm_bw * hw.hbm_eff)
    elem_f += (12 if k.fused else 30) * hw.kernel_launch  # kernels per block forward
    fwd = gemm_f + attn_f + elem_f
    if policy == "full":
        rec = fwd
    elif policy == "selective":
        # every other matmul (k, o, and the MLP's gate half of the up projection) and every
        # elementwise op; attention's output is kept
        rec = g["k"][0] + g["o"][0] + g["up"][0] / 2 + elem_f
    else:
        rec = 0.0
    bwd = gemm_b + attn_b + 2.0 * elem_f + rec
    return LayerCost(fwd, bwd, rec, gemm_f, attn_f, elem_f)


def head_cost(
    spec: ModelSpec, tokens: float, tp: int, hw: Hardware, k: Kernels, eff: float
) -> tuple[float, float]:
    """``(forward, backward)`` seconds of the final norm, LM head and loss on one GPU
    (vocabulary split ``tp`` ways), and of the embedding lookup; 0 without a vocabulary."""
    if spec.vocab <= 0:
        return 0.0, 0.0
    v = spec.vocab / tp
    f, b = linear_times(tokens, v, spec.hidden, hw, eff)
    loss = k.ce_bytes * tokens * v / (hw.hbm_bw * hw.hbm_eff)
    emb = 2.0 * 2.0 * tokens * spec.hidden / (hw.hbm_bw * hw.hbm_eff)  # gather; scatter-add
    return f + 0.4 * loss + emb, b + 0.6 * loss + emb
