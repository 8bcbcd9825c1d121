"""Hugging Face jobs of the paper-like scenarios' shapes, on synthetic data.

``maestro plan kd|mllm|mllm-audio --out plan.toml`` writes a run config naming one of these
(``workload.name = "maestro.hf.scenarios:kd"`` or ``":mllm"``): the scenario's sections as
``transformers`` models (``maestro.sim.scenarios.SHAPES``: a Llama-style teacher and
student; a SigLIP-style vision tower, a Whisper-style audio encoder and a Qwen2-style LLM)
with random weights, and per-step synthetic batches drawn from the scenario's length
distribution (``maestro.sim.scenarios.text_lengths``) and modality mix. At full scale the
``[workload]`` keys are the real shapes (hidden 4096, ...); ``maestro plan --scale-down K``
writes the same ratios shrunk (``scaled``), small enough to train here.

A batch is the same on every rank by construction: step ``k``'s samples are drawn from a
generator seeded by ``(seed, k)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

import torch

from maestro import Job, hf
from maestro.seeding import seed_for


@dataclass
class KDConfig:
    """The ``[workload]`` keys of ``maestro.hf.scenarios:kd`` (defaults: the ``kd``
    scenario's shapes; one vocabulary for both models, as logit distillation needs)."""

    vocab_size: int = 32000
    """Vocabulary of teacher and student."""
    teacher_hidden: int = 5120
    """Teacher width."""
    teacher_ffn: int = 41472
    """Teacher MLP width."""
    teacher_layers: int = 64
    """Teacher blocks."""
    teacher_heads: int = 40
    """Teacher attention heads."""
    student_hidden: int = 4096
    """Student width."""
    student_ffn: int = 16512
    """Student MLP width."""
    student_layers: int = 32
    """Student blocks."""
    student_heads: int = 32
    """Student attention heads."""
    median_tokens: int = 1024
    """Median sequence length (log-normal, clipped to ``[min_tokens, max_tokens]``)."""
    sigma: float = 1.0
    """Log-normal sigma of the lengths."""
    min_tokens: int = 32
    """Shortest sequence."""
    max_tokens: int = 8192
    """Longest sequence."""
    alpha: float = 0.5
    """Weight of the KL term."""
    temperature: float = 2.0
    """Distillation temperature."""
    top_k: int = 64
    """Teacher logits sent per token (0: all)."""

    def validate(self, where: str) -> None:
        _check_positive(self, where, ("sigma", "alpha", "temperature", "top_k"))
        for w, h in (("teacher_hidden", "teacher_heads"), ("student_hidden", "student_heads")):
            if getattr(self, w) % getattr(self, h):
                raise ValueError(f"{where}.{w} must be a multiple of {h}={getattr(self, h)}")
        _check_lengths(self, where)


@dataclass
class MLLMConfig:
    """The ``[workload]`` keys of ``maestro.hf.scenarios:mllm`` (defaults: the ``mllm``
    scenario's shapes: 256 image tokens, 375 audio tokens)."""

    vocab_size: int = 32000
    """LLM vocabulary (the last two ids are the image and audio placeholders)."""
    llm_hidden: int = 4096
    """LLM width."""
    llm_ffn: int = 16512
    """LLM MLP width."""
    llm_layers: int = 32
    """LLM blocks."""
    llm_heads: int = 32
    """LLM attention heads."""
    llm_kv_heads: int = 8
    """LLM key/value heads."""
    vision_hidden: int = 1280
    """Vision tower width."""
    vision_ffn: int = 5120
    """Vision MLP width."""
    vision_layers: int = 32
    """Vision blocks."""
    vision_heads: int = 16
    """Vision heads."""
    image_size: int = 224
    """Pixels per image side."""
    patch_size: int = 14
    """Pixels per patch side: ``(image_size / patch_size)^2`` image tokens."""
    audio_hidden: int = 1024
    """Audio encoder width."""
    audio_ffn: int = 4096
    """Audio MLP width."""
    audio_layers: int = 24
    """Audio encoder blocks (0: no audio section)."""
    audio_heads: int = 16
    """Audio heads."""
    audio_tokens: int = 375
    """LLM tokens per audio clip (the encoder's positions)."""
    num_mel_bins: int = 128
    """Mel bins of the audio features."""
    text_only: float = 0.4
    """Share of text-only samples."""
    audio_share: float = 0.0
    """Share of samples with an image and an audio clip (the rest: one image)."""
    median_tokens: int = 384
    """Median text length (log-normal, clipped)."""
    sigma: float = 1.0
    """Log-normal sigma of the text lengths."""
    min_tokens: int = 32
    """Shortest text."""
    max_tokens: int = 4096
    """Longest text."""

    def validate(self, where: str) -> None:
        _check_positive(self, where, ("sigma", "text_only", "audio_share", "audio_layers"))
        if self.image_size % self.patch_size:
            raise ValueError(f"{where}.patch_size must divide image_size={self.image_size}")
        if not 0 <= self.text_only <= 1 or not 0 <= self.audio_share <= 1 - self.text_only:
            raise ValueError(f"{where}: need 0 <= text_only and 0 <= audio_share <= 1 - text_only")
        if self.audio_share > 0 and self.audio_layers < 1:
            raise ValueError(f"{where}.audio_layers must be >= 1 when audio_share > 0")
        _check_lengths(self, where)


def _check_positive(c, where: str, skip: tuple[str, ...]) -> None:
    for f in fields(c):
        v = getattr(c, f.name)
        if f.name not in skip and isinstance(v, (int, float)) and not v >= 1:
            raise ValueError(f"{where}.{f.name} must be >= 1, got {v}")
    if not c.sigma >= 0:
        raise ValueError(f"{where}.sigma must be >= 0, got {c.sigma}")


def _check_lengths(c, where: str) -> None:
    if not 2 <= c.min_tokens <= c.median_tokens <= c.max_tokens:
        raise ValueError(
            f"{where}: need 2 <= min_tokens ({c.min_tokens}) <= median_tokens "
            f"({c.median_tokens}) <= max_tokens ({c.max_tokens})"
        )


def _lengths(c, seed: int, step: int, n: int) -> list[int]:
    from maestro.sim.scenarios import text_lengths

    rng = random.Random(seed_for("scenario lengths", seed, step))
    return text_lengths(rng, n, c.median_tokens, c.sigma, c.min_tokens, c.max_tokens)


def _llama(vocab, hidden, ffn, layers, heads, kv, max_len, cls=None):
    from transformers import LlamaConfig

    return (cls or LlamaConfig)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_len,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def kd(config) -> Job:
    """The ``kd`` scenario: a frozen Llama-style teacher feeding a Llama-style student."""
    c: KDConfig = config.model
    teacher = hf.causal_lm(
        _llama(
            c.vocab_size,
            c.teacher_hidden,
            c.teacher_ffn,
            c.teacher_layers,
            c.teacher_heads,
            c.teacher_heads,
            c.max_tokens,
        )
    )
    student = hf.causal_lm(
        _llama(
            c.vocab_size,
            c.student_hidden,
            c.student_ffn,
            c.student_layers,
            c.student_heads,
            c.student_heads,
            c.max_tokens,
        )
    )
    n, seed = config.global_batch, config.seed

    def batches(step: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed_for("scenario tokens", seed, step))
        return [
            {"input_ids": torch.randint(0, c.vocab_size, (t,), generator=g)}
            for t in _lengths(c, seed, step, n)
        ]

    sections = hf.kd_sections(
        teacher, student, alpha=c.alpha, temperature=c.temperature, top_k=c.top_k
    )
    return Job(sections, batches=batches)


def mllm(config) -> Job:
    """The ``mllm`` (and, with ``audio_share > 0``, ``mllm-audio``) scenario: a SigLIP-style
    vision tower (and a Whisper encoder) feeding a Qwen2-style LLM."""
    from transformers import Qwen2Config, SiglipVisionConfig, WhisperConfig

    c: MLLMConfig = config.model
    image_id, audio_id = c.vocab_size - 1, c.vocab_size - 2
    vision_tokens = (c.image_size // c.patch_size) ** 2
    longest = c.max_tokens + vision_tokens + (c.audio_tokens if c.audio_share else 0)
    llm = hf.causal_lm(
        _llama(
            c.vocab_size,
            c.llm_hidden,
            c.llm_ffn,
            c.llm_layers,
            c.llm_heads,
            c.llm_kv_heads,
            longest,
            Qwen2Config,
        )
    )
    vision = hf.vision_tower(
        SiglipVisionConfig(
            hidden_size=c.vision_hidden,
            intermediate_size=c.vision_ffn,
            num_hidden_layers=c.vision_layers,
            num_attention_heads=c.vision_heads,
            image_size=c.image_size,
            patch_size=c.patch_size,
            attention_dropout=0.0,
        ),
        out_dim=llm.hidden_size,
    )
    audio = None
    if c.audio_share > 0:
        audio = hf.audio_tower(
            WhisperConfig(
                d_model=c.audio_hidden,
                encoder_ffn_dim=c.audio_ffn,
                encoder_layers=c.audio_layers,
                encoder_attention_heads=c.audio_heads,
                decoder_layers=1,
                decoder_attention_heads=c.audio_heads,
                decoder_ffn_dim=c.audio_ffn,
                num_mel_bins=c.num_mel_bins,
                max_source_positions=c.audio_tokens,
                vocab_size=c.vocab_size,
                dropout=0.0,
                attention_dropout=0.0,
            ),
            out_dim=llm.hidden_size,
        )
    n, seed = config.global_batch, config.seed

    def batches(step: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed_for("scenario tokens", seed, step))
        rng = random.Random(seed_for("scenario modality", seed, step))
        out = []
        for t in _lengths(c, seed, step, n):
            u = rng.random()
            text = torch.randint(0, c.vocab_size - 2, (t,), generator=g)
            s: dict = {}
            head = []
            if u >= c.text_only:
                head.append(torch.full((vision.num_tokens,), image_id))
                s["pixel_values"] = torch.randn(*vision.image_spec.shape, generator=g)
            if audio is not None and c.text_only <= u < c.text_only + c.audio_share:
                head.append(torch.full((audio.num_tokens,), audio_id))
                s["input_features"] = torch.randn(*audio.feature_shape, generator=g)
            s["input_ids"] = torch.cat([*head, text])
            out.append(s)
        return out

    sections = hf.mllm_sections(
        llm,
        vision=vision,
        audio=audio,
        image_token_id=image_id,
        audio_token_id=audio_id if audio is not None else None,
    )
    return Job(sections, batches=batches)


kd.Config = KDConfig
mllm.Config = MLLMConfig

#: keys of each config that are widths (divided by the scale) and depths (layers)
_WIDTHS = ("hidden", "ffn", "vocab_size", "tokens", "image_size", "num_mel_bins")
_HEADS = {"teacher_heads": 4, "student_heads": 4, "llm_heads": 4, "llm_kv_heads": 2}


def scaled(c, k: int):
    """A copy of job config ``c`` with the same shape ratios, ``k`` times narrower.

    Widths, MLP widths, vocabularies and sequence lengths are divided by ``k``; layers by
    16 (at least 1; ``audio_layers`` stays 0 when 0); heads become 4 (key/value heads 2) and
    each width a multiple of them; vision and audio keep their tokens per sample ``/ k`` (at
    least 4: a 4-patch image of 4 x 4 pixels per patch).
    """
    if k < 1:
        raise ValueError(f"--scale-down must be >= 1, got {k}")
    out = {}
    for f in fields(c):
        v = getattr(c, f.name)
        if f.name.endswith("_layers"):
            out[f.name] = 0 if v == 0 else max(1, v // 16)
        elif f.name.endswith("_heads"):
            out[f.name] = _HEADS.get(f.name, 4)
        elif f.name == "patch_size":
            out[f.name] = 4
        elif isinstance(v, int) and any(f.name.endswith(w) for w in _WIDTHS):
            out[f.name] = max(8, v // k)
        else:
            out[f.name] = v
    for f in list(out):
        if f.endswith(("_hidden", "_ffn")):
            out[f] = -(-out[f] // 8) * 8  # a multiple of every head count
    if "image_size" in out:
        tokens = max(4, ((c.image_size // c.patch_size) ** 2) // k)
        side = max(2, int(round(tokens**0.5)))
        out["image_size"] = side * out["patch_size"]
    if "median_tokens" in out:
        out["min_tokens"] = max(2, c.min_tokens // k)
        out["median_tokens"] = max(out["min_tokens"], c.median_tokens // k)
        out["max_tokens"] = max(out["median_tokens"], c.max_tokens // k)
    return replace(c, **out)


def scenario_job(name: str, text_only: float = 0.4, audio_share: float = 0.15):
    """``(workload name, job config)`` of the Hugging Face job of scenario ``name`` (``kd``,
    ``mllm`` or ``mllm-audio``) at full scale."""
    if name == "kd":
        return "maestro.hf.scenarios:kd", KDConfig()
    if name == "mllm":
        return "maestro.hf.scenarios:mllm", MLLMConfig(text_only=text_only, audio_layers=0)
    if name == "mllm-audio":
        return "maestro.hf.scenarios:mllm", MLLMConfig(text_only=text_only, audio_share=audio_share)
    raise ValueError(f"no Hugging Face job for scenario {name!r}; choose kd, mllm or mllm-audio")


__all__ = ["KDConfig", "MLLMConfig", "kd", "mllm", "scaled", "scenario_job"]
