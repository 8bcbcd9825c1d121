"""Context parallelism (CP): one sample's sequence split over the ranks of a CP group.

A CP group (``[sections.X] cp``, ``maestro.parallel.mesh``) shares its replica's micro-batches;
each rank holds a load-balanced share of every sequence. A sequence of ``T`` tokens is cut
into ``2 * cp`` chunks of ``T // (2 cp)`` or one more tokens; CP rank ``r`` holds chunks ``r``
and ``2 cp - 1 - r`` (the "head and tail" split: every rank gets the same share of the causal
triangle). Uneven lengths need no padding of the data: chunks differ by at most one token,
and the K/V exchange pads internally to equal shapes and masks the pad out.

How the user's forward runs unchanged (``cp_forward``): the runtime gives it, for each sample,
two *chunk samples* (head chunk, tail chunk), in sample order. A chunk sample's tensors of the
sequence's length ``T`` on dim 0 (``tokens``/``input_ids``, ``labels``) are cut to the chunk
plus one *overlap* token (the next chunk's first, absent at the end of the sequence), and
tensors of length ``T - 1`` (next-token predictions, e.g. a teacher's logits) to the chunk's
own predictions. A forward that predicts token ``t + 1`` from position ``t`` of each sample
(and drops the last position's logits) therefore computes exactly its chunks' targets, and
the overlap token is a query only: its key and value are masked out of attention, so nothing
is counted twice. Every ``torch.nn.functional.scaled_dot_product_attention`` call inside the
forward is routed to ``ring_attention`` (``SDPAToRing``, a ``TorchFunctionMode``), which knows
each row's global positions. Positions for the model's own position embeddings or rotary
(``position_ids``) come from ``positions``.

Outputs: a per-sample scalar (a sink's loss) is the sum over the chunk samples and over the
CP group (its value is the whole sample's, its gradient this rank's share). A tensor of the
chunk sample's length (or one less) on dim 0 stays this rank's *piece* (its two chunks' rows,
``merge_outputs(gather=False)``): each CP rank of a producer sends its piece to the consumers,
which ``assemble`` the whole sequence (``T`` or ``T - 1`` rows), and each keeps its own rows
of the gradients that come back (``own_rows``), so no rank ever holds another's rows of a wide
per-token output (a teacher's logits). Parameter gradients are summed over the CP group by
the executor, and a producer sends each CP rank of a consumer only its ``share`` of every
sequence (``unshare`` sums the ranks' gradients back).
A forward that assembles the sequence it attends over itself (text with an image's tokens
spliced in) declares how to cut it instead: ``Section(cp_split=SequenceSplit(...))``; its
producers send it whole outputs.

Why not ``torch.distributed.tensor.experimental.context_parallel``: under torch 2.13 on CPU it
raises ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered``; it also needs the sequence as a DTensor
buffer of the whole model's inputs, which a compound section's forward does not expose. The
attention here is plain tensor math (matmuls, ``logsumexp``), the same code on CUDA/NCCL and
CPU/gloo. The keys and values travel a ring of point-to-point ``isend``/``irecv`` on the CP
group (which gloo and NCCL both have; gloo has no ``reduce_scatter``, the collective an
all-gather design would return gradients with), so a rank holds its own block and the one in
flight, never the whole sequence's; in the backward the blocks travel again with their
gradient accumulators, which arrive home after ``cp`` hops. Each block is attended in query
tiles (``TILE`` rows) merged by log-sum-exp, so at most ``TILE x block`` scores are live.
Only the sequence lengths of a call are exchanged with a (tiny) ``all_gather``: the forward
pads its chunk samples its own way and the ring needs equal shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: the active CP context while a CP section's forward runs (``cp_forward``)
_ACTIVE: list[CPContext] = []


def chunk_bounds(length: int, cp: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the ``2 * cp`` chunks of a sequence of ``length`` tokens (the
    first ``length % (2 cp)`` chunks one token longer: ``estimate.pipeline.even_bounds``)."""
    from maestro.estimate.pipeline import even_bounds

    return even_bounds(length, 2 * cp)


def rank_chunks(index: int, cp: int) -> tuple[int, int]:
    """The two chunks CP rank ``index`` holds: ``index`` and ``2 cp - 1 - index``."""
    return index, 2 * cp - 1 - index


def sequence_length(sample, where: str) -> int:
    """The sample's token count (``input_ids`` or ``tokens``); ``ValueError`` without one."""
    from maestro.job import TOKEN_KEYS

    for k in TOKEN_KEYS:
        v = sample.get(k)
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    raise ValueError(
        f"{where}.cp: context parallelism splits a sample's token sequence, but this sample "
        f"has no {' or '.join(TOKEN_KEYS)} tensor"
    )


def _cut(value, length: int, start: int, vlen: int):
    """``value`` cut for a chunk sample (see the module docstring); others unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape[0] == length:
        return value[start : start + vlen]
    if value.shape[0] == length - 1:
        return value[start : start + vlen - 1]
    return value


@dataclass
class CPContext:
    """What ring attention needs about the micro-batch being run.

    Args:
        group: the CP process group.
        cp: its size.
        index: this rank's index in it.
        rows: per CP rank, per chunk-sample row of its batch: ``(start, num_keys)``, the
            row's first global position and its real (non-overlap) tokens.
        where: the config table, for errors.
        ranks: the group's global ranks in CP order (the ring).
    """

    group: object
    cp: int
    index: int
    rows: list[list[tuple[int, int]]]
    where: str
    #: the group's global ranks, in CP order (the ring's order)
    ranks: list[int] = field(default_factory=list)
    #: SDPA calls seen so far (a forward with none is refused)
    calls: int = 0
    _pos: dict = field(default_factory=dict)

    def row_positions(self, rank: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, is_key)`` of rank ``rank``'s rows, each ``(rows, length)``."""
        key = (rank, length, str(device))
        if key not in self._pos:
            starts = torch.tensor([s for s, _ in self.rows[rank]], device=device)
            nkeys = torch.tensor([n for _, n in self.rows[rank]], device=device)
            t = torch.arange(length, device=device)
            self._pos[key] = (starts[:, None] + t, t[None, :] < nkeys[:, None])
        return self._pos[key]


def positions(batch: int, length: int, device=None) -> torch.Tensor | None:
    """Global positions ``(batch, length)`` of the rows a CP section's forward is running
    (each chunk sample's own), or ``None`` outside context parallelism, where positions are
    ``arange(length)``. A model with learned positions or rotary embeddings calls it (or
    gets ``position_ids`` from its forward) so positions follow the rank's share."""
    if not _ACTIVE:
        return None
    ctx = _ACTIVE[-1]
    pos, _ = ctx.row_positions(ctx.index, length, device)
    if pos.shape[0] != batch:
        raise ValueError(
            f"{ctx.where}.cp: the forward runs {batch} rows, but its micro-batch has "
            f"{pos.shape[0]} chunk samples (two per sample, in order, right-padded)"
        )
    return pos


class SDPAToRing(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to ``ring_attention`` under ``ctx``."""

    def __init__(self, ctx: CPContext) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(self.ctx, *args, **kwargs)
        return func(*args, **kwargs)


def _sdpa(
    ctx: CPContext,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    ctx.calls += 1
    why = None
    if attn_mask is not None:
        why = (
            "its attention passes an attn_mask to scaled_dot_product_attention; context "
            "parallelism honours only causal (is_causal=True) or no mask"
        )
    elif dropout_p:
        why = "its attention uses dropout (dropout_p > 0)"
    elif query.dim() != 4:
        why = f"scaled_dot_product_attention got {query.dim()}-D queries; need (B, H, L, D)"
    elif query.shape[0] != len(ctx.rows[ctx.index]):
        why = (
            f"its attention runs {query.shape[0]} rows, but the micro-batch has "
            f"{len(ctx.rows[ctx.index])} chunk samples: the forward must batch its samples "
            "in order, right-padded"
        )
    if why is not None:
        raise ValueError(f"{ctx.where}.cp: cannot split this section's attention: {why}")
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return ring_attention(query, key, value, ctx, bool(is_causal), float(scale))


def ring_attention(q, k, v, ctx: CPContext, causal: bool, scale: float) -> torch.Tensor:
    """Attention of this rank's rows ``q, k, v`` (``(B, H, L, D)``; rows ``2i, 2i + 1`` are
    sample ``i``'s head and tail chunk) against every CP rank's keys and values, equal to the
    whole sequence's attention at this rank's positions (``ctx.rows``). Low-precision inputs
    (bf16, fp16) are computed in float32, outside autocast: the log-sum-exp merge of blocks
    needs it; the result is cast back."""
    dtype = q.dtype
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    with torch.autocast(q.device.type, enabled=False):
        out = _RingAttention.apply(q.to(acc), k.to(acc), v.to(acc), ctx, causal, scale)
    return out.to(dtype)


def _to_samples(x: torch.Tensor) -> torch.Tensor:
    """``(2S, H, L, D) -> (S, H, 2L, D)``: a sample's two chunk rows side by side."""
    b, h, n, d = x.shape
    return x.view(b // 2, 2, h, n, d).transpose(1, 2).reshape(b // 2, h, 2 * n, d)


def _from_samples(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_to_samples`` for rows of length ``n``."""
    s, h, _, d = x.shape
    return x.view(s, h, 2, n, d).transpose(1, 2).reshape(2 * s, h, n, d)


#: query rows per tile: a block's scores are at most ``TILE x keys`` at a time
TILE = 1024


def _exchange(tensors: list[torch.Tensor], ctx: CPContext) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring, receive the previous rank's (same
    shapes): point-to-point on the CP group, all posted before any is waited for."""
    nxt = ctx.ranks[(ctx.index + 1) % ctx.cp]
    prv = ctx.ranks[(ctx.index - 1) % ctx.cp]
    tensors = [t.contiguous() for t in tensors]
    got = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    reqs = [dist.isend(t, nxt, group=ctx.group) for t in tensors]
    reqs += [dist.irecv(g, prv, group=ctx.group) for g in got]
    for r in reqs:
        r.wait()
    return got


def _common_length(x: torch.Tensor, ctx: CPContext) -> tuple[torch.Tensor, list[int]]:
    """``x`` (``(B, H, L, D)``) right-padded to the longest ``L`` of the group, and every
    rank's ``L`` (the forward pads its chunk samples its own way)."""
    n = torch.tensor([x.shape[2]], device=x.device)
    ns = [torch.zeros_like(n) for _ in range(ctx.cp)]
    dist.all_gather(ns, n, group=ctx.group)
    lens = [int(t) for t in ns]
    return F.pad(x, (0, 0, 0, max(lens) - x.shape[2])).contiguous(), lens


def _mask(ctx: CPContext, rank: int, qpos, m: int, causal: bool, device) -> torch.Tensor:
    """``(S, 1, Q, 2m)``: which of rank ``rank``'s keys (rows padded to ``m``) each query
    (global positions ``qpos``, ``(S, Q)``) sees."""
    kpos, is_key = ctx.row_positions(rank, m, device)
    kpos, is_key = kpos.reshape(-1, 2 * m), is_key.reshape(-1, 2 * m)  # (S, 2m)
    mask = is_key[:, None, :].expand(-1, qpos.shape[1], -1)
    if causal:
        mask = mask & (kpos[:, None, :] <= qpos[:, :, None])
    return mask[:, None]


def _tiles(num: int):
    return [slice(a, min(a + TILE, num)) for a in range(0, num, TILE)]


class _RingAttention(torch.autograd.Function):
    """Forward: the keys and values travel the ring (``cp - 1`` hops), each rank attending to
    each block as it passes, merged by log-sum-exp. Backward: they travel again with their
    gradient accumulators, which arrive home after ``cp`` hops. Each rank keeps only its own
    keys and values, and at most ``TILE x block`` scores at a time."""

    @staticmethod
    def forward(fctx, q, k, v, ctx: CPContext, causal: bool, scale: float):
        n = q.shape[2]
        kp, lens = _common_length(k, ctx)
        vp, _ = _common_length(v, ctx)
        m = kp.shape[2]
        qs = _to_samples(q)  # (S, H, 2n, D)
        qpos = ctx.row_positions(ctx.index, n, q.device)[0].reshape(-1, 2 * n)
        out = torch.zeros_like(qs)
        lse = torch.full(qs.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
        cur = [kp, vp]
        for step in range(ctx.cp):
            src = (ctx.index - step) % ctx.cp
            kr, vr = _to_samples(cur[0]), _to_samples(cur[1])  # (S, H, 2m, D)
            for t in _tiles(2 * n):
                mask = _mask(ctx, src, qpos[:, t], m, causal, q.device)
                sc = (qs[:, :, t] @ kr.transpose(-1, -2)) * scale
                sc = sc.masked_fill(~mask, float("-inf"))
                lse_r = torch.logsumexp(sc, dim=-1, keepdim=True)
                o_r = torch.exp(sc - _finite(lse_r)) @ vr
                new = torch.logaddexp(lse[:, :, t], lse_r)
                safe = _finite(new)
                out[:, :, t] = (
                    torch.exp(lse[:, :, t] - safe) * out[:, :, t] + torch.exp(lse_r - safe) * o_r
                )
                lse[:, :, t] = new
            if step < ctx.cp - 1:
                cur = _exchange(cur, ctx)
        fctx.save_for_backward(qs, kp, vp, out, lse)
        fctx.ctx, fctx.causal, fctx.scale, fctx.n, fctx.lens = ctx, causal, scale, n, lens
        return _from_samples(out, n)

    @staticmethod
    def backward(fctx, grad):
        with torch.autocast(grad.device.type, enabled=False):
            return _RingAttention._backward(fctx, grad)

    @staticmethod
    def _backward(fctx, grad):
        qs, kp, vp, out, lse = fctx.saved_tensors
        ctx, causal, scale, n = fctx.ctx, fctx.causal, fctx.scale, fctx.n
        m = kp.shape[2]
        do = _to_samples(grad.contiguous())
        qpos = ctx.row_positions(ctx.index, n, qs.device)[0].reshape(-1, 2 * n)
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qs)
        # the block and its gradient accumulators travel together
        cur = [kp, vp, torch.zeros_like(kp), torch.zeros_like(vp)]
        for step in range(ctx.cp):
            src = (ctx.index - step) % ctx.cp
            kr, vr = _to_samples(cur[0]), _to_samples(cur[1])
            dk, dv = torch.zeros_like(kr), torch.zeros_like(vr)
            for t in _tiles(2 * n):
                mask = _mask(ctx, src, qpos[:, t], m, causal, qs.device)
                sc = (qs[:, :, t] @ kr.transpose(-1, -2)) * scale
                p = torch.exp(sc - _finite(lse[:, :, t])).masked_fill(~mask, 0.0)
                ds = p * (do[:, :, t] @ vr.transpose(-1, -2) - delta[:, :, t]) * scale
                dq[:, :, t] += ds @ kr
                dk += ds.transpose(-1, -2) @ qs[:, :, t]
                dv += p.transpose(-1, -2) @ do[:, :, t]
            cur[2] = cur[2] + _from_samples(dk, m)
            cur[3] = cur[3] + _from_samples(dv, m)
            # cp hops bring the accumulators home; the last one needs no keys or values
            if step < ctx.cp - 1:
                cur = _exchange(cur, ctx)
            elif ctx.cp > 1:
                cur = cur[:2] + _exchange(cur[2:], ctx)
        own = fctx.lens[ctx.index]
        return _from_samples(dq, n), cur[2][:, :, :own], cur[3][:, :, :own], None, None, None


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with infinities replaced by 0 (rows that see no key in a block)."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


@contextlib.contextmanager
def active(ctx: CPContext):
    """Run a forward under ``ctx``: SDPA calls become ring attention; ``positions`` works."""
    _ACTIVE.append(ctx)
    try:
        with SDPAToRing(ctx):
            yield ctx
    finally:
        _ACTIVE.pop()


def _vlen(bounds, c: int, length: int) -> int:
    """Tokens of chunk ``c``'s chunk sample: the chunk and, before the end, one overlap."""
    start, end = bounds[c]
    return end - start + (1 if end < length else 0)


def _share_rows(bounds, cp: int, index: int, length: int, full: int) -> list[tuple[int, int]]:
    """``[(start, rows)]`` of CP rank ``index``'s two chunk samples in a per-sample tensor
    of ``full`` rows (``length``: one per position; ``length - 1``: per prediction)."""
    out = []
    for c in rank_chunks(index, cp):
        n = _vlen(bounds, c, length) - (0 if full == length else 1)
        out.append((bounds[c][0], n))
    return out


def share(outputs: dict, length: int, cp: int, index: int) -> dict:
    """What a producer sends CP rank ``index`` of a consumer about one sample of ``length``
    tokens: each sequence tensor (first dimension ``length`` or ``length - 1``) cut to the
    rows of the rank's two chunk samples, concatenated; other values whole."""
    bounds = chunk_bounds(length, cp)
    out = {}
    for k, x in outputs.items():
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] in (length, length - 1):
            rows = _share_rows(bounds, cp, index, length, x.shape[0])
            out[k] = torch.cat([x[s : s + n] for s, n in rows])
        else:
            out[k] = x
    return out


def unshare(grad: torch.Tensor, like: torch.Tensor, length: int, cp: int, index: int):
    """The gradient of a whole output ``like`` from the gradient of the ``share`` CP rank
    ``index`` received (zeros outside its rows; a whole tensor's gradient as it is)."""
    if like.dim() == 0 or like.shape[0] not in (length, length - 1) or grad.shape == like.shape:
        return grad  # sent whole (a share is always shorter: 2 cp <= length)
    full = torch.zeros_like(like)
    off = 0
    for s, n in _share_rows(chunk_bounds(length, cp), cp, index, length, like.shape[0]):
        full[s : s + n] += grad[off : off + n]
        off += n
    return full


def keep_context(fn):
    """``fn`` bound to the CP context active now (``fn`` itself outside CP): a block that
    ``torch.utils.checkpoint`` recomputes in the backward runs ring attention again, under
    the same context, on every CP rank in the same order."""
    if not _ACTIVE:
        return fn
    ctx = _ACTIVE[-1]

    def run(*args, **kwargs):
        if _ACTIVE and _ACTIVE[-1] is ctx:
            return fn(*args, **kwargs)
        with active(ctx):
            return fn(*args, **kwargs)

    return run


@dataclass(frozen=True)
class SequenceSplit:
    """How to cut a sample whose attention sequence its section's forward assembles itself
    (``Section(cp_split=...)``), e.g. an LLM that splices an image's tokens into the text.

    Args:
        length: ``length(sample, inputs) -> int``: the sequence the forward attends over
            (``inputs``: ``producer -> outputs or None`` of this sample, whole).
        cut: ``cut(sample, inputs, start, end) -> (chunk sample, chunk inputs)``: a sample and
            inputs on which the forward builds exactly positions ``start .. end - 1`` of that
            sequence (predicting each next element as it does for the whole one).

    The producers of such a section send it whole outputs (no ``share``).
    """

    length: object
    cut: object


def assemble(pieces: Sequence[torch.Tensor], length: int, cp: int) -> torch.Tensor:
    """A whole per-sample sequence tensor from every CP rank's piece (``pieces[r]``: rank
    ``r``'s rows of its two chunks, as a CP producer sends them, ``merge_outputs(gather=
    False)``): ``length`` rows per position, or one fewer (per prediction)."""
    bounds = chunk_bounds(length, cp)
    parts = []
    for c in range(2 * cp):
        r = c if c < cp else 2 * cp - 1 - c
        head = bounds[r][1] - bounds[r][0]  # the first chunk is never the last: whole
        parts.append(pieces[r][:head] if c == r else pieces[r][head:])
    return torch.cat(parts)


def own_rows(whole: torch.Tensor, length: int, cp: int, index: int) -> torch.Tensor:
    """CP rank ``index``'s piece of a whole per-sample sequence tensor (``assemble``'s
    inverse for one rank; e.g. the gradient a CP producer's rank keeps)."""
    bounds = chunk_bounds(length, cp)
    a, b = rank_chunks(index, cp)
    full = whole.shape[0]
    return torch.cat(
        [whole[bounds[a][0] : bounds[a][1]], whole[bounds[b][0] : min(bounds[b][1], full)]]
    )


def unshare_rows(grad: torch.Tensor, length: int, cp: int, index: int) -> torch.Tensor:
    """``unshare`` for a gradient whose whole shape is not known here (a CP producer holds
    only its own rows): its kind (per position or per prediction) read off its row count;
    any other tensor is returned as it is (it was sent whole)."""
    bounds = chunk_bounds(length, cp)
    per_pos = sum(n for _, n in _share_rows(bounds, cp, index, length, length))
    if grad.dim() == 0 or grad.shape[0] not in (per_pos, per_pos - 2):
        return grad
    full = length if grad.shape[0] == per_pos else length - 1
    like = grad.new_zeros((full, *grad.shape[1:]))
    return unshare(grad, like, length, cp, index)


def split_micro_batch(
    samples,
    inputs,
    cp: int,
    index: int,
    where: str,
    shared: bool = False,
    split: SequenceSplit | None = None,
):
    """``(chunk samples, chunk inputs, rows)`` of a micro-batch for CP rank ``index``:
    two chunk samples per sample (see the module docstring) and every rank's rows
    (``CPContext.rows``). ``shared``: the inputs are already this rank's ``share`` (as the
    executor sends them), else whole. ``split``: the section's own ``SequenceSplit``."""
    vs: list = []
    vin: dict[str, list] = {p: [] for p in inputs}
    rows: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for i, s in enumerate(samples):
        mine_in = {p: col[i] for p, col in inputs.items()}
        length = sequence_length(s, where) if split is None else split.length(s, mine_in)
        if length < 2 * cp:
            raise ValueError(
                f"{where}.cp = {cp}: a sample has {length} tokens, fewer than 2 x cp = "
                f"{2 * cp} (every rank needs two non-empty chunks)"
            )
        bounds = chunk_bounds(length, cp)
        for r in range(cp):
            for c in rank_chunks(r, cp):
                rows[r].append((bounds[c][0], bounds[c][1] - bounds[c][0]))
        mine = rank_chunks(index, cp)
        for j, c in enumerate(mine):
            start = bounds[c][0]
            vlen = _vlen(bounds, c, length)
            if split is not None:
                cs, cin = split.cut(s, mine_in, start, start + vlen)
                vs.append(cs)
                for p in inputs:
                    vin[p].append(cin.get(p))
                continue
            vs.append({k: _cut(x, length, start, vlen) for k, x in s.items()})
            for p, col in inputs.items():
                o = col[i]
                if o is None:
                    vin[p].append(None)
                elif shared:
                    vin[p].append({k: _cut_share(x, bounds, mine, length, j) for k, x in o.items()})
                else:
                    vin[p].append({k: _cut(x, length, start, vlen) for k, x in o.items()})
    return vs, vin, rows


def _cut_share(x, bounds, mine, length: int, j: int):
    """Chunk sample ``j``'s (0: head, 1: tail) rows of a received ``share``."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    vh, vt = (_vlen(bounds, c, length) for c in mine)
    if x.shape[0] == vh + vt:
        return x[:vh] if j == 0 else x[vh:]
    if x.shape[0] == vh + vt - 2:
        return x[: vh - 1] if j == 0 else x[vh - 1 :]
    return x


def merge_outputs(
    outs, samples, cp: int, index: int, group, where: str, gather: bool = True
) -> list[dict]:
    """Whole per-sample outputs from this rank's chunk outputs (see the module docstring).
    ``gather=False``: a sequence tensor stays this rank's piece (its two chunks' rows, for
    ``assemble`` at the consumer); scalars are still summed over the group."""
    scalars: list[tuple[int, str, torch.Tensor]] = []
    merged: list[dict] = []
    for i, s in enumerate(samples):
        length = sequence_length(s, where)
        bounds = chunk_bounds(length, cp)
        a, b = outs[2 * i], outs[2 * i + 1]
        out = {}
        for key, x in a.items():
            if not isinstance(x, torch.Tensor):
                out[key] = x
            elif x.dim() == 0:
                scalars.append((i, key, x + b[key]))
            elif gather:
                out[key] = _gather_sequence(
                    key, (x, b[key]), bounds, length, cp, index, group, where
                )
            else:
                out[key] = _own_piece(key, (x, b[key]), bounds, length, cp, index, where)
        merged.append(out)
    if scalars:
        local = torch.stack([x for _, _, x in scalars])
        total = local.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        # value: the whole sample's; gradient: this rank's share
        whole = local + (total - local.detach())
        for j, (i, key, _) in enumerate(scalars):
            merged[i][key] = whole[j]
    return merged


def _full_rows(key, pieces, bounds, length, cp, index, where) -> int:
    """The whole sequence's rows of output ``key``: ``length`` (one per position) or
    ``length - 1`` (next-token predictions), read off this rank's head chunk sample's;
    ``ValueError`` for any other shape."""
    vlen = _vlen(bounds, rank_chunks(index, cp)[0], length)
    if pieces[0].shape[0] == vlen:
        return length
    if pieces[0].shape[0] == vlen - 1:
        return length - 1
    raise ValueError(
        f"{where}.cp: output {key!r} has {pieces[0].shape[0]} rows for a chunk of "
        f"{vlen} tokens; a CP section's per-sample outputs must be scalars or have one "
        "row per token (or per predicted token)"
    )


def _own_piece(key, pieces, bounds, length, cp, index, where) -> torch.Tensor:
    """This rank's rows of one per-sample sequence output (its two chunks, in order)."""
    full = _full_rows(key, pieces, bounds, length, cp, index, where)
    rows = [max(min(bounds[c][1], full) - bounds[c][0], 0) for c in rank_chunks(index, cp)]
    return torch.cat([p[:n] for p, n in zip(pieces, rows)])


def _gather_sequence(key, pieces, bounds, length, cp, index, group, where) -> torch.Tensor:
    """One per-sample tensor made whole over the CP group (rows in global order)."""
    own = rank_chunks(index, cp)
    full = _full_rows(key, pieces, bounds, length, cp, index, where)

    def rows(c):
        s, e = bounds[c]
        return max(min(e, full) - s, 0)

    mine = torch.cat([p[: rows(c)] for p, c in zip(pieces, own)])
    sizes = [sum(rows(c) for c in rank_chunks(r, cp)) for r in range(cp)]
    most = max(sizes)
    buf = torch.zeros((most, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    buf[: mine.shape[0]] = mine.detach()
    got = [torch.empty_like(buf) for _ in range(cp)]
    dist.all_gather(got, buf, group=group)
    parts = []
    for c in range(2 * cp):
        r = c if c < cp else 2 * cp - 1 - c
        if r == index:
            off = 0 if c == own[0] else rows(own[0])
            parts.append(mine[off : off + rows(c)])
        else:
            first = rank_chunks(r, cp)[0]
            off = 0 if c == first else rows(first)
            parts.append(got[r][off : off + rows(c)])
    return torch.cat(parts)


def cp_forward(
    forward,
    cp: int,
    index: int,
    group,
    where: str,
    shared: bool = False,
    ranks: Sequence[int] | None = None,
    split: SequenceSplit | None = None,
    gather: bool = True,
):
    """Wrap a section forward ``forward(module, samples, inputs)`` for CP rank ``index``:
    split, run under ring attention, merge (module docstring). ``shared``: the inputs are
    this rank's ``share`` of the producers' outputs; ``ranks``: the CP group's global ranks
    in CP order (default ``0 .. cp - 1``); ``split``: the section's ``SequenceSplit`` (its
    inputs arrive whole). Raises ``ValueError`` naming ``where`` when the forward calls no
    ``scaled_dot_product_attention``. ``gather=False``: sequence outputs stay this rank's
    pieces (``merge_outputs``)."""
    ring = list(ranks) if ranks is not None else list(range(cp))

    def run(module, samples: Sequence, inputs):
        vs, vin, rows = split_micro_batch(samples, inputs, cp, index, where, shared, split)
        ctx = CPContext(group=group, cp=cp, index=index, rows=rows, where=where, ranks=ring)
        with active(ctx):
            outs = forward(module, vs, vin)
        if ctx.calls == 0:
            raise ValueError(
                f"{where}.cp: no torch.nn.functional.scaled_dot_product_attention call in the "
                "section's forward, so its attention cannot be split (use SDPA, e.g. "
                'attn_implementation="sdpa", or cp = 1)'
            )
        if len(outs) != len(vs):
            raise ValueError(f"{where}.cp: the forward returned {len(outs)} outputs for {len(vs)}")
        from maestro.parallel.pipeline import HIDDEN

        if outs and HIDDEN in outs[0]:
            # a pipeline stage before the last: its hidden state (this rank's chunk samples'
            # rows) goes to the same CP rank of the next stage as it is
            return [outs[0]] + [{} for _ in samples[1:]]
        return merge_outputs(outs, samples, cp, index, group, where, gather)

    return run
