"""Multimodal LLM: ViT-style vision (and audio) encoders whose tokens are spliced into text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from maestro.config import MLLMConfig
from maestro.sections import Outputs, Sample, Section
from maestro.workloads.base import Workload
from maestro.workloads.data import BigramLanguage, draw_kinds, long_tailed_lengths, seed_for
from maestro.workloads.layers import Decoder, Encoder, pad_stack

IGNORE = -100


def has_image(sample: Sample) -> bool:
    """Activation of the ``vision`` section."""
    return "image" in sample


def has_audio(sample: Sample) -> bool:
    """Activation of the ``audio`` section."""
    return "audio" in sample


class MLLMWorkload(Workload):
    """``vision`` (+ ``audio``) -> ``llm``. Encoders include their projector to the LLM width.

    A sample is text with an image inserted at ``image_pos`` (and audio at ``audio_pos``) when
    its kind has them. The LLM predicts every text token but the first from the position just
    before it in the interleaved sequence; image and audio positions have no target.
    """

    def __init__(self, config) -> None:
        super().__init__(config)
        self.cfg: MLLMConfig = config.model
        self.language = BigramLanguage(self.cfg.vocab_size, config.seed)

    def _module(self, name: str) -> nn.Module:
        c = self.cfg
        if name == "vision":
            return Encoder(
                c.patch_dim,
                c.vision_dim,
                c.vision_layers,
                c.heads,
                c.image_patches,
                c.llm_dim,
                pool=c.image_pool,
            )
        if name == "audio":
            return Encoder(
                c.frame_dim, c.audio_dim, c.audio_layers, c.heads, c.audio_frames, c.llm_dim
            )
        max_len = c.seq_len_max + c.image_patches // c.image_pool + c.audio_frames
        return Decoder(c.vocab_size, c.llm_dim, c.llm_layers, c.heads, max_len)

    def _section(self, name: str, module: nn.Module) -> Section:
        inputs = self.config.section_inputs()[name]
        frozen = self.config.sections[name].frozen
        if name == "llm":
            return Section(name, module, inputs=inputs, frozen=frozen, forward=self._llm_forward)
        key = "image" if name == "vision" else "audio"
        act = has_image if name == "vision" else has_audio
        return Section(
            name,
            module,
            inputs=inputs,
            frozen=frozen,
            activates_on=act,
            forward=lambda m, samples, _inputs: _encode(m, samples, key),
        )

    def _llm_forward(
        self, module: nn.Module, samples: Sequence[Sample], inputs: Mapping
    ) -> list[Outputs]:
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
                parts += [text[prev:pos], emb]
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

    def batch(self, step: int) -> list[Sample]:
        c = self.cfg
        n = self.config.global_batch
        g = torch.Generator().manual_seed(seed_for("batch", self.config.seed, step))
        lens = long_tailed_lengths(g, n, c.seq_len_min, c.seq_len_max)
        toks = self.language.sample(g, lens)
        kinds = draw_kinds(g, n, c.mix)
        batch = []
        for i, (t, kind) in enumerate(zip(toks, kinds)):
            s = {"id": i, "kind": kind, "tokens": t}
            if "image" in kind:
                s["image"] = torch.randn(c.image_patches, c.patch_dim, generator=g).to(self.dtype)
                s["image_pos"] = int(torch.randint(1, t.numel(), (1,), generator=g))
            if "audio" in kind:
                s["audio"] = torch.randn(c.audio_frames, c.frame_dim, generator=g).to(self.dtype)
                s["audio_pos"] = int(torch.randint(1, t.numel(), (1,), generator=g))
            batch.append(s)
        return batch

    def _cost(self, sample: Sample) -> dict[str, float]:
        n = sample["tokens"].numel()
        img = int("image" in sample)
        aud = int("audio" in sample)
        c = self.cfg
        tokens = n + img * (c.image_patches // c.image_pool) + aud * c.audio_frames
        return {"tokens": tokens, "text_tokens": n, "images": img, "audio": aud}


def _encode(module: nn.Module, samples: Sequence[Sample], key: str) -> list[Outputs]:
    out = module(torch.stack([s[key] for s in samples]))  # (B, P, D_llm)
    return [{"embeds": out[i]} for i in range(len(samples))]
