"""Multimodal LLM: ViT-style vision (and audio) encoders whose tokens are spliced into text.

``job(config)`` is the built-in ``mllm`` job (``[workload] name = "mllm"``), written with the
public job API only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from maestro.config import MLLMConfig
from maestro.job import Job
from maestro.parallel.cp import SequenceSplit
from maestro.sections import Outputs, Sample, Section
from maestro.workloads.data import BigramLanguage, draw_kinds, long_tailed_lengths, seed_for
from maestro.workloads.layers import Decoder, Encoder, pad_stack

IGNORE = -100


def has_image(sample: Sample) -> bool:
    """Activation of the ``vision`` section."""
    return "image" in sample


def has_audio(sample: Sample) -> bool:
    """Activation of the ``audio`` section."""
    return "audio" in sample


def job(config) -> Job:
    """The ``mllm`` job: ``vision`` (+ ``audio``) -> ``llm``; encoders include their projector.

    A sample is text with an image inserted at ``image_pos`` (and audio at ``audio_pos``) when
    its kind has them. The LLM predicts every text token but the first from the position just
    before it in the interleaved sequence; image and audio positions have no target.
    """
    c: MLLMConfig = config.model
    language = BigramLanguage(c.vocab_size, config.seed)
    ins = c.default_inputs()
    from maestro.job import param_dtype

    data_dtype = param_dtype(config, frozen=False)

    def llm(module: nn.Module, samples: Sequence[Sample], inputs: Mapping) -> list[Outputs]:
        seqs, labels = [], []
        for i, s in enumerate(samples):
            toks = s["tokens"]
            inserts = []  # (text position, (N, D) embeddings) in text order
            for sec, pos_key in (("vision", "image_pos"), ("audio", "audio_pos")):
                got = inputs[sec][i] if sec in inputs else None
                if got is not None:
                    inserts.append((s[pos_key], got["embeds"]))
            inserts.sort(key=lambda p: p[0])
            text = module.tok(toks)  # (L, D)
            parts, ids, prev = [], [], 0
            for pos, emb in inserts:
                parts += [text[prev:pos], emb.to(text.dtype)]
                ids += [toks[prev:pos], toks.new_full((emb.shape[0],), IGNORE)]
                prev = pos
            parts.append(text[prev:])
            ids.append(toks[prev:])
            seqs.append(torch.cat(parts))
            full = torch.cat(ids)  # (N,) text ids, IGNORE at image/audio positions
            labels.append(torch.cat([full[1:], full.new_full((1,), IGNORE)]))
        logits = module.forward_embeds(pad_stack(seqs))  # (B, T, V)
        return [
            {
                "loss": F.cross_entropy(
                    logits[i, : y.numel()], y, ignore_index=IGNORE, reduction="sum"
                )
            }
            for i, y in enumerate(labels)
        ]

    def batches(step: int) -> list[Sample]:
        n = config.global_batch
        g = torch.Generator().manual_seed(seed_for("batch", config.seed, step))
        lens = long_tailed_lengths(g, n, c.seq_len_min, c.seq_len_max)
        toks = language.sample(g, lens)
        kinds = draw_kinds(g, n, c.mix)
        batch = []
        for t, kind in zip(toks, kinds):
            s = {"kind": kind, "tokens": t}
            if "image" in kind:
                s["image"] = torch.randn(c.image_patches, c.patch_dim, generator=g).to(data_dtype)
                s["image_pos"] = int(torch.randint(1, t.numel(), (1,), generator=g))
            if "audio" in kind:
                s["audio"] = torch.randn(c.audio_frames, c.frame_dim, generator=g).to(data_dtype)
                s["audio_pos"] = int(torch.randint(1, t.numel(), (1,), generator=g))
            batch.append(s)
        return batch

    def cost(sample: Sample) -> dict[str, float]:
        n = sample["tokens"].numel()
        img = int("image" in sample)
        aud = int("audio" in sample)
        tokens = n + img * (c.image_patches // c.image_pool) + aud * c.audio_frames
        return {"tokens": tokens, "text_tokens": n, "images": img, "audio": aud}

    max_len = c.seq_len_max + c.image_patches // c.image_pool + c.audio_frames
    sections = [
        Section(
            "vision",
            lambda: Encoder(
                c.patch_dim,
                c.vision_dim,
                c.vision_layers,
                c.heads,
                c.image_patches,
                c.llm_dim,
                pool=c.image_pool,
            ),
            inputs=ins["vision"],
            activates_on=has_image,
            forward=lambda m, samples, _inputs: _encode(m, samples, "image"),
        )
    ]
    if "audio" in ins:
        sections.append(
            Section(
                "audio",
                lambda: Encoder(
                    c.frame_dim, c.audio_dim, c.audio_layers, c.heads, c.audio_frames, c.llm_dim
                ),
                inputs=ins["audio"],
                activates_on=has_audio,
                forward=lambda m, samples, _inputs: _encode(m, samples, "audio"),
            )
        )
    sections.append(
        Section(
            "llm",
            lambda: Decoder(c.vocab_size, c.llm_dim, c.llm_layers, c.heads, max_len),
            inputs=ins["llm"],
            forward=llm,
            # context parallelism cuts the interleaved sequence the forward builds
            cp_split=SequenceSplit(length=_fused_length, cut=_fused_cut),
        )
    )
    return Job(sections, batches=batches, sample_cost=cost)


#: the ``[workload]`` table's settings (validated when the config loads)
job.Config = MLLMConfig


#: the LLM's inserts: producer section, the sample's key of its text position
_INSERTS = (("vision", "image_pos"), ("audio", "audio_pos"))


def _segments(sample: Sample, inputs: Mapping) -> list[tuple[str, int, int]]:
    """The LLM's interleaved sequence as ``[(what, begin, end)]`` in order: ``"text"`` token
    ranges and each producer's embedding rows (inserted before text position ``*_pos``)."""
    inserts = sorted(
        (sample[key], sec, inputs[sec]["embeds"].shape[0])
        for sec, key in _INSERTS
        if inputs.get(sec) is not None
    )
    out, prev = [], 0
    for pos, sec, rows in inserts:
        out += [("text", prev, pos), (sec, 0, rows)]
        prev = pos
    return out + [("text", prev, sample["tokens"].numel())]


def _fused_length(sample: Sample, inputs: Mapping) -> int:
    return sum(e - b for _, b, e in _segments(sample, inputs))


def _fused_cut(sample: Sample, inputs: Mapping, start: int, end: int):
    """A sample and inputs on which ``llm`` builds exactly positions ``start .. end - 1`` of
    the interleaved sequence: its text tokens there, and the embedding rows there inserted at
    their place among those tokens."""
    text, got, at = [], {}, 0
    chunk = {k: v for k, v in sample.items() if k not in ("tokens", "image_pos", "audio_pos")}
    count = 0  # text tokens of the chunk so far
    for what, b, e in _segments(sample, inputs):
        lo, hi = max(b, b + start - at), min(e, b + end - at)
        if lo < hi:
            if what == "text":
                text.append(sample["tokens"][lo:hi])
                count += hi - lo
            else:
                got[what] = {"embeds": inputs[what]["embeds"][lo:hi]}
                chunk[dict(_INSERTS)[what]] = count
        at += e - b
    chunk["tokens"] = torch.cat(text) if text else sample["tokens"][:0]
    return chunk, {p: got.get(p) for p in inputs}


def _encode(module: nn.Module, samples: Sequence[Sample], key: str) -> list[Outputs]:
    out = module(torch.stack([s[key] for s in samples]))  # (B, P, D_llm)
    return [{"embeds": out[i]} for i in range(len(samples))]
