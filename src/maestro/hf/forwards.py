"""Section forwards for Hugging Face modules: KD teacher and student, encoders, a LLaVA-style LLM.

Each ``*_forward`` returns a ``forward(module, samples, inputs) -> list of per-sample dicts``
for ``maestro.Section``. A micro-batch is right-padded with an attention mask and every
sample's outputs are sliced back to its own length, so padding does not change a sample's
result (causal attention: a real position never sees a padded one). Sinks return a scalar
``"loss"`` summed over the sample's targets (``reduction="sum"``); the runtime divides by the
global batch's normaliser (predicted tokens by default, see ``maestro.job``).

Samples carry ``input_ids`` (``(L,)`` int64), optionally ``labels`` (``(L,)``, ``-100`` for
positions without a target; token ``t`` is predicted from position ``t - 1``), and for
multimodal samples ``pixel_values`` (``(C, H, W)``) or ``input_features`` (``(mel, frames)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from maestro.job import IGNORE_INDEX
from maestro.parallel.cp import positions
from maestro.sections import Outputs, Sample

Forward = Callable[[nn.Module, Sequence[Sample], Mapping], list[Outputs]]


def pad_right(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(L_i, ...)`` tensors into ``(B, T, ...)`` with zeros, and the ``(B, T)`` mask."""
    t = max(s.shape[0] for s in seqs)
    out = seqs[0].new_zeros((len(seqs), t, *seqs[0].shape[1:]))
    mask = torch.zeros(len(seqs), t, dtype=torch.long, device=seqs[0].device)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = 1
    return out, mask


def targets(sample: Sample) -> torch.Tensor:
    """The ``(L - 1,)`` next-token targets of a sample: ``labels[1:]`` if given, else
    ``input_ids[1:]``."""
    labels = sample.get("labels")
    ids = sample["input_ids"]
    return (labels if isinstance(labels, torch.Tensor) else ids)[1:]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (bf16 logits), float64 kept (exactness runs)."""
    return t if t.dtype == torch.float64 else t.float()


def _logits(module: nn.Module, samples: Sequence[Sample]) -> torch.Tensor:
    ids, mask = pad_right([s["input_ids"] for s in samples])
    pos = positions(ids.shape[0], ids.shape[1], ids.device)
    if pos is not None:
        # context parallelism: rotary positions of this rank's share of each sequence; no
        # padding mask (causal attention over right padding needs none, and ring attention
        # masks the padded keys itself)
        return module(input_ids=ids, position_ids=pos, use_cache=False).logits
    return module(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, V)


def lm_forward() -> Forward:
    """A causal LM sink: per-sample summed next-token cross-entropy."""

    def forward(module, samples, inputs):
        logits = _logits(module, samples)
        return [
            {
                "loss": F.cross_entropy(
                    _wide(logits[i, : s["input_ids"].numel() - 1]),
                    targets(s),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
            }
            for i, s in enumerate(samples)
        ]

    return forward


def kd_teacher_forward(top_k: int = 0) -> Forward:
    """A frozen teacher LM: sends per-token ``logits`` ``(L - 1, V)``, or with ``top_k`` its
    ``top_values`` and ``top_indices`` ``(L - 1, k)`` (k values and k indices per token)."""

    def forward(module, samples, inputs):
        logits = _logits(module, samples)
        outs = []
        for i, s in enumerate(samples):
            lg = logits[i, : s["input_ids"].numel() - 1]  # predictions of tokens 1..L-1
            if top_k:
                v, idx = lg.topk(top_k, dim=-1)
                outs.append({"top_values": v.contiguous(), "top_indices": idx.contiguous()})
            else:
                outs.append({"logits": lg.contiguous()})
        return outs

    return forward


def kd_loss(
    student_logits: torch.Tensor,
    target: torch.Tensor,
    teacher: Mapping[str, torch.Tensor] | None,
    *,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """``sum over targets of CE + alpha * T^2 * KL(p_T || p_S)`` for one sample.

    Args:
        student_logits: ``(N, V)`` the student's predictions.
        target: ``(N,)`` token ids, ``-100`` where there is no target (no CE, no KL there).
        teacher: ``{"logits": (N, V)}`` or ``{"top_values", "top_indices": (N, k)}`` (the
            teacher's distribution renormalised over its top k), or ``None`` (CE only).
        alpha: weight of the KL term.
        temperature: softening ``T`` of both distributions.
    """
    lg = _wide(student_logits)
    loss = F.cross_entropy(lg, target, ignore_index=IGNORE_INDEX, reduction="sum")
    if teacher is None or not alpha:
        return loss
    keep = target != IGNORE_INDEX
    log_ps = F.log_softmax(lg / temperature, dim=-1)
    if "logits" in teacher:
        t = teacher["logits"]
        if t.shape[-1] != lg.shape[-1]:
            raise ValueError(
                f"KD: teacher vocabulary {t.shape[-1]} != student vocabulary {lg.shape[-1]}"
            )
        log_pt = F.log_softmax(_wide(t) / temperature, dim=-1)
        kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    else:
        log_pt = F.log_softmax(_wide(teacher["top_values"]) / temperature, dim=-1)
        kl = (log_pt.exp() * (log_pt - log_ps.gather(-1, teacher["top_indices"]))).sum(-1)
    # a masked sum, not kl[keep]: boolean indexing has no meta kernel (the FLOP count)
    return loss + alpha * temperature**2 * torch.where(keep, kl, 0.0).sum()


def kd_student_forward(
    alpha: float = 0.5, temperature: float = 2.0, teacher: str = "teacher"
) -> Forward:
    """A student LM sink trained on ``CE + alpha * T^2 * KL`` against section ``teacher``."""

    def forward(module, samples, inputs):
        logits = _logits(module, samples)
        got = inputs.get(teacher, [None] * len(samples))
        return [
            {
                "loss": kd_loss(
                    logits[i, : s["input_ids"].numel() - 1],
                    targets(s),
                    got[i],
                    alpha=alpha,
                    temperature=temperature,
                )
            }
            for i, s in enumerate(samples)
        ]

    return forward


def encoder_forward(key: str) -> Forward:
    """A tower (``maestro.hf.models.Tower``): ``sample[key]`` of every sample, stacked, to
    per-sample ``{"embeds": (N, D_llm)}``."""

    def forward(module, samples, inputs):
        dtype = next(module.parameters()).dtype
        x = torch.stack([s[key] for s in samples]).to(dtype)  # (B, *feature shape)
        out = module(x)  # (B, N, D)
        return [{"embeds": out[i]} for i in range(len(samples))]

    return forward


def multimodal_lm_forward(placeholders: Mapping[str, int]) -> Forward:
    """A LLaVA-style LLM sink: encoder embeddings spliced into ``inputs_embeds``.

    Args:
        placeholders: ``producer section -> placeholder token id``: the rows of a sample's
            token embeddings where ``input_ids == id`` are replaced, in order, by that
            producer's ``embeds`` for the sample (their counts must match). Placeholder
            positions have no target (``-100``) unless the sample brings its own ``labels``.
    """
    placeholders = dict(placeholders)

    def forward(module, samples, inputs):
        embed = module.get_input_embeddings()
        seqs, tgts = [], []
        for i, s in enumerate(samples):
            ids = s["input_ids"]
            x = embed(ids)  # (L, D)
            is_ph = torch.zeros_like(ids, dtype=torch.bool)
            for sec, token_id in placeholders.items():
                at = ids == token_id
                is_ph |= at
                got = inputs[sec][i] if sec in inputs else None
                # meta tensors (the planner's FLOP count) have no values to check counts with
                n = None if ids.device.type == "meta" else int(at.sum())
                if got is None:
                    if n:
                        raise ValueError(
                            f"sample {s.get('id')}: {n} placeholder tokens (id {token_id}) for "
                            f"section {sec!r}, which did not run on it"
                        )
                    continue
                e = got["embeds"]
                if n is not None and e.shape[0] != n:
                    raise ValueError(
                        f"sample {s.get('id')}: {n} placeholder tokens (id {token_id}) but "
                        f"section {sec!r} sent {e.shape[0]} embeddings"
                    )
                x = x.masked_scatter(at[:, None].expand_as(x), e.to(x.dtype))
            seqs.append(x)
            if isinstance(s.get("labels"), torch.Tensor):
                tgts.append(s["labels"][1:])
            else:
                tgts.append(ids.masked_fill(is_ph, IGNORE_INDEX)[1:])
        embeds, mask = pad_right(seqs)  # (B, T, D), (B, T)
        pos = positions(embeds.shape[0], embeds.shape[1], embeds.device)
        if pos is not None:  # context parallelism: see ``_logits``
            logits = module(inputs_embeds=embeds, position_ids=pos, use_cache=False).logits
        else:
            logits = module(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
        return [
            {
                "loss": F.cross_entropy(
                    _wide(logits[i, : y.numel()]), y, ignore_index=IGNORE_INDEX, reduction="sum"
                )
            }
            for i, y in enumerate(tgts)
        ]

    return forward


def multimodal_cp_split(placeholders: Mapping[str, int]):
    """How context parallelism cuts a ``multimodal_lm_forward`` sample: its ``input_ids`` and
    ``labels`` to the chunk, each producer's ``embeds`` to the rows of the chunk's
    placeholder tokens (``maestro.parallel.cp.SequenceSplit``)."""
    from maestro.parallel.cp import SequenceSplit

    placeholders = dict(placeholders)

    def length(sample, inputs):
        return int(sample["input_ids"].shape[0])

    def cut(sample, inputs, start, end):
        ids = sample["input_ids"]
        chunk = dict(sample)
        for k in ("input_ids", "labels"):
            if isinstance(sample.get(k), torch.Tensor):
                chunk[k] = sample[k][start:end]
        got = {}
        for sec, token_id in placeholders.items():
            o = inputs.get(sec)
            if o is None:
                continue
            at = ids == token_id
            a, b = int(at[:start].sum()), int(at[:end].sum())
            if b > a:
                got[sec] = {**o, "embeds": o["embeds"][a:b]}
        return chunk, {p: got.get(p) for p in inputs}

    return SequenceSplit(length=length, cut=cut)


def has(key: str) -> Callable[[Sample], bool]:
    """``activates_on`` for a modality: the sample has ``key`` (e.g. ``pixel_values``)."""

    def activates_on(sample: Sample) -> bool:
        return sample.get(key) is not None

    activates_on.__name__ = f"has_{key}"
    return activates_on
