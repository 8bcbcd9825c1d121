"""One training job on one layout: step time, tokens/s per GPU, MFU, peak memory per GPU and
where the time goes (``maestro estimate``).

The layout is torchtitan's / Megatron-LM's: ``gpus = dp * fsdp * tp * pp * cp`` with TP
innermost (one NVLink domain), then CP, then the FSDP shard group, then HSDP replicas and
pipeline stages. Per micro-batch and pipeline stage the blocks' kernels come from
``maestro.estimate.kernels``; the collectives are rings priced here:

- TP with sequence parallelism: per block, two all-gathers and two reduce-scatters of the
  ``(tokens, hidden)`` activations in the forward, the same in the backward (and again for a
  recomputed forward); exposed unless the framework overlaps them.
- CP (ring attention, load-balanced causal chunks): each block passes its K/V chunk around
  the ring in the forward, K/V and their gradients in the backward, overlapped with the
  attention it feeds; what exceeds that attention is exposed.
- FSDP: the forward all-gathers every unit's bf16 parameters, the backward again for the
  blocks (``reshard_after_forward``) and reduce-scatters the gradients, per micro-batch,
  prefetched under compute: only the first unit's gather, the last unit's reduce-scatter and
  what exceeds the micro-batch's compute are exposed. HSDP adds an all-reduce of the shards
  across replicas. Megatron's distributed optimizer reduce-scatters gradients and
  all-gathers parameters once per step, overlapped with the last backward and first forward.
- Overlapped collectives take SMs: compute running beside them is slower by
  ``Hardware.overlap_slowdown``.
- Pipeline: 1F1B's bubble is ``(pp - 1) / vpp`` micro-batch times of one stage
  (interleaved 1F1B with ``vpp`` virtual stages; Narayanan et al. 2021, eq. 1 and 2).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from maestro.estimate.framework import Framework, framework
from maestro.estimate.hardware import Hardware, hardware
from maestro.estimate.kernels import (
    RECOMPUTE,
    activation_bytes,
    attention_pairs,
    head_cost,
    layer_cost,
)
from maestro.estimate.models import ModelSpec, model
from maestro.estimate.pipeline import cp_ring_exposed, pipeline_makespan, stage_send_seconds


def ring_time(nbytes: float, n: int, hw: Hardware, inside_node: bool) -> float:
    """An all-gather or reduce-scatter of ``nbytes`` (the whole tensor) over ``n`` ranks;
    an all-reduce is two."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = hw.nvlink_bw * hw.nvlink_eff if inside_node else hw.net_bw * hw.net_eff
    return (n - 1) / n * nbytes / bw + (n - 1) * hw.link_latency


@dataclass(frozen=True)
class Layout:
    """How the job's GPUs are split (``gpus = dp * fsdp * tp * pp * cp``).

    Args:
        dp: HSDP replicas (or plain data-parallel replicas when ``fsdp = 1``).
        fsdp: FSDP shard degree (ranks sharing one copy of the state).
        tp: tensor-parallel degree (inside a node).
        pp: pipeline stages.
        cp: context-parallel degree (ring attention).
        vpp: virtual stages per pipeline rank (interleaved 1F1B; 1 = plain 1F1B).
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: ``dp * fsdp``."""
        return self.dp * self.fsdp


@dataclass
class Estimate:
    """What ``estimate`` predicts for one step.

    Args:
        step_time: seconds per optimizer step.
        tokens_per_s_per_gpu: trained tokens per second per GPU.
        mfu: model FLOPs utilization (6 x non-embedding parameters plus 12 x layers x
            attention width x sequence per token, torchtitan's and Megatron-LM's
            convention) over the hardware's dense bf16 peak.
        peak_memory: bytes per GPU at the busiest pipeline stage (reserved, with the
            allocator's headroom).
        breakdown: seconds per step: ``compute`` (kernels, without recompute),
            ``recompute``, ``exposed_comm`` (collectives not hidden under compute),
            ``overlap_slowdown`` (compute slowed by collectives beside it), ``bubble``
            (pipeline fill and drain), ``optimizer``, ``padding`` (compute on pad tokens).
        memory: bytes per GPU by kind (``state``, ``gathered``, ``activations``, ``logits``,
            ``headroom``).
        layout, model, hardware, framework: what was estimated.
        micro_batches: micro-batches per step per data-parallel rank.
        fits: ``peak_memory`` fits the hardware's memory.
    """

    step_time: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_memory: float
    breakdown: dict[str, float]
    memory: dict[str, float]
    layout: Layout
    model: str
    hardware: str
    framework: str
    micro_batches: int
    tokens_per_step: float
    fits: bool = True
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layout"] = asdict(self.layout)
        return d

    def table(self) -> str:
        """A readable summary."""
        lay = self.layout
        lines = [
            f"{self.model} on {lay.gpus} x {self.hardware} ({self.framework}): "
            f"dp {lay.dp}, fsdp {lay.fsdp}, tp {lay.tp}, pp {lay.pp}, cp {lay.cp}"
            + (f", vpp {lay.vpp}" if lay.vpp > 1 else ""),
            f"step {self.step_time:.3f} s, {self.micro_batches} micro-batches per rank, "
            f"{self.tokens_per_step:,.0f} tokens per step",
            f"throughput {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"MFU {100 * self.mfu:.1f}%",
            f"peak memory {self.peak_memory / 2**30:.1f} GiB per GPU"
            + ("" if self.fits else " (does not fit)"),
            "time per step:",
        ]
        for k, v in self.breakdown.items():
            share = 100 * v / self.step_time if self.step_time else 0.0
            lines.append(f"  {k:<18}{v:>9.3f} s {share:>6.1f}%")
        lines.append("memory per GPU:")
        for k, v in self.memory.items():
            lines.append(f"  {k:<18}{v / 2**30:>9.2f} GiB")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def resolve_layout(
    gpus: int,
    *,
    dp: int | None = None,
    fsdp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int = 1,
    default_fsdp: bool = True,
) -> Layout:
    """The layout of ``gpus`` GPUs: the data-parallel ranks ``gpus / (tp * pp * cp)`` split
    into ``dp`` replicas of ``fsdp`` shards (default: all of them one FSDP group when
    ``default_fsdp``, else plain replicas). ``ValueError`` says what does not divide."""
    for name, v in (("gpus", gpus), ("tp", tp), ("pp", pp), ("cp", cp), ("vpp", vpp)):
        if v < 1:
            raise ValueError(f"--{name} must be >= 1, got {v}")
    model_par = tp * pp * cp
    if gpus % model_par:
        raise ValueError(
            f"--gpus {gpus} is not divisible by tp * pp * cp = {tp} * {pp} * {cp} = {model_par}"
        )
    data = gpus // model_par
    if dp is not None and dp < 1:
        raise ValueError(f"--dp must be >= 1, got {dp}")
    if fsdp is not None and fsdp < 1:
        raise ValueError(f"--fsdp must be >= 1, got {fsdp}")
    if dp is None and fsdp is None:
        dp, fsdp = (1, data) if default_fsdp else (data, 1)
    elif dp is None:
        if data % fsdp:
            raise ValueError(f"--fsdp {fsdp} does not divide the {data} data-parallel ranks")
        dp = data // fsdp
    elif fsdp is None:
        if data % dp:
            raise ValueError(f"--dp {dp} does not divide the {data} data-parallel ranks")
        fsdp = data // dp
    if dp * fsdp != data:
        raise ValueError(
            f"dp * fsdp = {dp} * {fsdp} = {dp * fsdp}, but gpus / (tp * pp * cp) = {data}"
        )
    return Layout(dp=dp, fsdp=fsdp, tp=tp, pp=pp, cp=cp, vpp=vpp)


def model_flops_per_token(spec: ModelSpec, seq_len: float) -> float:
    """Training FLOPs per token by torchtitan's and Megatron-LM's convention: ``6 x``
    parameters without the embedding, plus ``12 x layers x heads x head_dim x seq``."""
    n = spec.params - spec.embedding_params
    return 6.0 * n + 12.0 * spec.layers * spec.q_dim * seq_len


def estimate(
    model_name: str | ModelSpec,
    *,
    gpus: int = 8,
    seq_len: int = 4096,
    micro_batch: int = 1,
    global_batch: int | None = None,
    dp: int | None = None,
    fsdp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int = 1,
    recompute: str = "selective",
    dtype: str = "bf16",
    hardware_name: str | Hardware = "h100-sxm",
    framework_name: str | Framework = "torchtitan",
) -> Estimate:
    """Estimate one training step of ``model_name`` on a layout (see the module docstring).

    Args:
        model_name: a preset (``maestro.estimate.models.PRESETS``), a Hugging Face
            ``config.json`` (file or directory) or a ``ModelSpec``.
        gpus: GPUs of the job.
        seq_len: tokens per sample.
        micro_batch: samples per micro-batch per data-parallel rank.
        global_batch: samples per step (default: one micro-batch per data-parallel rank);
            must be a multiple of ``micro_batch * dp * fsdp``.
        dp, fsdp, tp, pp, cp, vpp: the layout (``resolve_layout``).
        recompute: ``none`` | ``selective`` | ``full``.
        dtype: ``bf16`` (the only one priced).
        hardware_name: a hardware preset (``maestro.estimate.hardware.HARDWARE``).
        framework_name: ``torchtitan`` (eager, what ``maestro train`` runs),
            ``torchtitan-compile`` or ``megatron``.
    """
    spec = model(model_name)
    hw = hardware(hardware_name)
    fw = framework(framework_name)
    if dtype != "bf16":
        raise ValueError(f"--dtype {dtype!r}: only bf16 is priced")
    if recompute not in RECOMPUTE:
        raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if seq_len < 1 or micro_batch < 1:
        raise ValueError("--seq-len and --micro-batch must be >= 1")
    lay = resolve_layout(
        gpus, dp=dp, fsdp=fsdp, tp=tp, pp=pp, cp=cp, vpp=vpp, default_fsdp=fw.optimizer == "fsdp"
    )
    if spec.heads % lay.tp:
        raise ValueError(f"--tp {lay.tp} must divide the model's {spec.heads} attention heads")
    if lay.tp > hw.gpus_per_node:
        raise ValueError(f"--tp {lay.tp} exceeds the {hw.gpus_per_node} GPUs of one node")
    if lay.pp > spec.layers:
        raise ValueError(f"--pp {lay.pp} exceeds the model's {spec.layers} layers")
    if lay.vpp > 1 and (lay.pp == 1 or spec.layers % (lay.pp * lay.vpp)):
        raise ValueError(
            f"--vpp {lay.vpp} needs pp > 1 and layers ({spec.layers}) divisible by pp * vpp"
        )
    if seq_len % lay.cp:
        raise ValueError(f"--seq-len {seq_len} is not divisible by --cp {lay.cp}")
    per_step = micro_batch * lay.data_parallel
    if global_batch is None:
        global_batch = per_step
    if global_batch < per_step or global_batch % per_step:
        raise ValueError(
            f"--global-batch {global_batch} must be a multiple of micro_batch * dp * fsdp = "
            f"{micro_batch} * {lay.data_parallel} = {per_step}"
        )
    m = global_batch // per_step
    if lay.pp > 1 and m < lay.pp:
        raise ValueError(
            f"{m} micro-batches per step cannot fill {lay.pp} pipeline stages: raise "
            "--global-batch or lower --micro-batch"
        )

    eff = fw.kernel_efficiency
    k = fw.kernels
    tokens = micro_batch * seq_len / lay.cp  # positions per GPU per micro-batch
    pairs = micro_batch * attention_pairs([float(seq_len)], seq_len, spec.causal) / lay.cp
    lc = layer_cost(spec, tokens, pairs, seq_len, lay.tp, recompute, hw, k, eff)
    head_f, head_b = head_cost(spec, tokens, lay.tp, hw, k, eff)
    layers_stage = math.ceil(spec.layers / lay.pp)
    node = hw.gpus_per_node

    # tensor parallel (sequence parallel): 4 collectives of (tokens, hidden) per block and pass
    act = tokens * spec.hidden * 2.0
    tp_one = ring_time(act, lay.tp, hw, True)
    tp_passes = 2.0 + (1.0 if recompute == "full" else 0.5 if recompute == "selective" else 0.0)
    tp_comm = 4.0 * tp_one * tp_passes * layers_stage if lay.tp > 1 else 0.0
    # context parallel: K/V chunks around the ring, hidden under that block's attention
    cp_comm = 0.0
    if lay.cp > 1:
        kv = 2.0 * tokens * spec.kv_dim / lay.tp * 2.0
        f_cp, b_cp = cp_ring_exposed(kv, lay.cp, lc.attn_fwd, hw, lay.cp * lay.tp <= node)
        cp_comm = layers_stage * (f_cp + b_cp)

    compute_f = layers_stage * lc.fwd + head_f
    compute_b = layers_stage * lc.bwd + head_b
    recompute_s = layers_stage * lc.recompute
    mb_compute = compute_f + compute_b
    slow = hw.overlap_slowdown - 1.0
    exposed = cp_comm * m
    slowdown = 0.0
    if fw.tp_overlap:
        slowdown += slow * min(tp_comm, mb_compute) * m
        exposed += max(0.0, tp_comm - mb_compute) * m
    else:
        exposed += tp_comm * m

    # parameters of the busiest stage, per TP rank
    stage_params = (layers_stage * spec.layer_params + spec.head_params) / lay.tp
    block_params = layers_stage * spec.layer_params / lay.tp
    units = layers_stage + 1
    inside = lambda n: n * lay.tp * lay.cp <= node  # noqa: E731  (a group of n data ranks)
    if fw.optimizer == "fsdp":
        f = lay.fsdp
        per_mb = 0.0
        if f > 1:
            per_mb = (
                ring_time(2.0 * (stage_params + spec.embedding_params / lay.tp), f, hw, inside(f))
                + ring_time(2.0 * block_params, f, hw, inside(f))
                + ring_time(fw.reduce_bytes * stage_params, f, hw, inside(f))
            )
        step_comm = 0.0
        if lay.dp > 1:  # HSDP (or DDP) all-reduce of the shards across replicas
            step_comm = 2.0 * ring_time(
                fw.reduce_bytes * stage_params / f, lay.dp, hw, inside(lay.dp * f)
            )
        hidden = mb_compute
        exposed += m * (max(0.0, per_mb - hidden) + per_mb / units)
        slowdown += slow * m * min(per_mb, hidden)
        exposed += max(0.0, step_comm - compute_b) + step_comm / units
        slowdown += slow * min(step_comm, compute_b)
        state = 16.0 * stage_params / f + 16.0 * spec.embedding_params / lay.tp / f
        gathered = 2.0 * 2.0 * spec.layer_params / lay.tp  # the block and the prefetched one
        gathered += 2.0 * (spec.embedding_params + spec.head_params) / lay.tp  # the root
        gathered += (2.0 + fw.reduce_bytes) * spec.layer_params / lay.tp  # unsharded grads
        shard = (stage_params + spec.embedding_params / lay.tp) / f
    else:  # Megatron distributed optimizer over all data-parallel ranks
        d = lay.data_parallel
        all_params = stage_params + spec.embedding_params / lay.tp
        comm = ring_time(fw.reduce_bytes * all_params, d, hw, inside(d)) + ring_time(
            2.0 * all_params, d, hw, inside(d)
        )
        hidden = mb_compute  # the last backward and the first forward
        exposed += max(0.0, comm - hidden)
        slowdown += slow * min(comm, hidden)
        state = (2.0 + 4.0) * all_params + 12.0 * all_params / d
        gathered = 0.0
        shard = all_params / d

    pipe = m * mb_compute
    bubble = 0.0
    if lay.pp > 1:  # the busiest stage on every stage: 1F1B replayed (maestro.estimate.pipeline)
        send = stage_send_seconds(2.0 * act, hw, lay.pp * lay.tp * lay.cp <= node)
        fwd = [[compute_f] * lay.pp] * m
        bwd = [[compute_b] * lay.pp] * m
        bubble = pipeline_makespan(fwd, bwd, send, send, lay.vpp) - pipe
    # Adam: read parameter, gradient and both moments (fp32), write three, write bf16 copy
    optim = 30.0 * shard / (hw.hbm_bw * hw.hbm_eff)
    step = pipe + bubble + exposed + slowdown + optim

    tokens_step = float(global_batch * seq_len)
    tps = tokens_step / step / lay.gpus
    mfu = tps * model_flops_per_token(spec, seq_len) / hw.flops

    # activations: a stage holds pp micro-batches in flight under 1F1B (its first stage)
    in_flight = 1.0 if lay.pp == 1 else lay.pp * (1.0 + (lay.pp - 1) / (lay.pp * lay.vpp))
    per_layer = activation_bytes(spec, recompute, k) * tokens / lay.tp
    acts = in_flight * layers_stage / lay.vpp * lay.vpp * per_layer
    if recompute != "none":  # one block's full activations while it is recomputed
        acts += (activation_bytes(spec, "none", k) - activation_bytes(spec, recompute, k)) * (
            tokens / lay.tp
        )
    logits = k.logit_bytes * tokens * spec.vocab / lay.tp
    alloc = state + gathered + acts + logits
    headroom = fw.allocator_headroom * alloc
    peak = alloc + headroom
    notes = []
    fits = peak <= hw.memory
    if not fits:
        notes.append(
            f"does not fit: needs {peak / 2**30:.1f} GiB per GPU, the {hw.name} has "
            f"{hw.memory / 2**30:.1f} GiB ({(peak - hw.memory) / 2**30:.1f} GiB over)"
        )
    breakdown = {
        "compute": m * (mb_compute - recompute_s),
        "recompute": m * recompute_s,
        "exposed_comm": exposed,
        "overlap_slowdown": slowdown,
        "bubble": bubble,
        "optimizer": optim,
        "padding": 0.0,
    }
    memory = {
        "state": state,
        "gathered": gathered,
        "activations": acts,
        "logits": logits,
        "headroom": headroom,
    }
    return Estimate(
        step_time=step,
        tokens_per_s_per_gpu=tps,
        mfu=mfu,
        peak_memory=peak,
        breakdown=breakdown,
        memory=memory,
        layout=lay,
        model=spec.name,
        hardware=hw.name,
        framework=fw.name,
        micro_batches=m,
        tokens_per_step=tokens_step,
        fits=fits,
        notes=notes,
    )
