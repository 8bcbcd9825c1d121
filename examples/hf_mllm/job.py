"""A LLaVA-style MLLM: a SigLIP-style vision tower and a Qwen2-style LLM, from JSONL + .npy.

Run it (3 ranks: the vision tower on one, two LLM replicas on the others)::

    python examples/hf_mllm/make_data.py        # data/train.jsonl and data/images/*.npy
    maestro train examples/hf_mllm/hf_mllm.toml --nproc 3

About 40% of the records are text only: they skip the vision rank, and the wavefront
scheduler starts the LLM on them while the tower encodes the images. A record with an image
holds one placeholder token (id ``image_token_id``, by default the last id of the
vocabulary) where the image goes; it is expanded to the tower's image tokens and carries no
target (``hf.MultimodalTokens``). Images are ``.npy`` arrays (uint8 ``(H, W, 3)``, resized
and normalised to the tower's ``pixel_values``; or float ``(3, S, S)`` already processed) or
PNG/JPEG files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen2Config, SiglipVisionConfig

from maestro import Job, hf
from maestro.data import JsonlDataset


@dataclass
class Config:
    """The ``[workload]`` keys of this job."""

    data: str = "data/train.jsonl"
    """JSONL of ``{"input_ids": [...], "image": "images/0.npy"}`` (``image`` optional);
    relative to the TOML's directory (images relative to the JSONL file)."""
    vocab_size: int = 256
    """LLM vocabulary, the image placeholder included."""
    image_token_id: int = -1
    """Placeholder id of an image (-1: ``vocab_size - 1``)."""
    max_length: int = 160
    """Longest sequence, image tokens included."""
    llm_hidden: int = 64
    """LLM width (the projector's output width)."""
    llm_layers: int = 2
    """LLM blocks."""
    llm_heads: int = 4
    """LLM attention heads."""
    llm_kv_heads: int = 2
    """LLM key/value heads (grouped-query attention, as in Qwen2)."""
    vision_hidden: int = 64
    """Vision encoder width."""
    vision_layers: int = 2
    """Vision encoder blocks."""
    vision_heads: int = 4
    """Vision encoder heads."""
    image_size: int = 32
    """Pixels per image side after resizing."""
    patch_size: int = 8
    """Pixels per patch side: (image_size / patch_size)^2 image tokens per image."""
    llm_path: str = ""
    """A local ``save_pretrained`` directory to load the LLM from ("" : config)."""

    def validate(self, where: str) -> None:
        for f in ("vocab_size", "max_length", "llm_hidden", "llm_layers", "vision_hidden"):
            if getattr(self, f) < 1:
                raise ValueError(f"{where}.{f} must be >= 1, got {getattr(self, f)}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"{where}.patch_size must divide image_size={self.image_size}, "
                f"got {self.patch_size}"
            )
        if not -1 <= self.image_token_id < self.vocab_size:
            raise ValueError(
                f"{where}.image_token_id must be -1 or in [0, vocab_size), "
                f"got {self.image_token_id}"
            )


def job(config) -> Job:
    """vision (image samples only) -> llm (every sample)."""
    c: Config = config.model
    here = Path(config.config_dir or ".")
    image_token = c.image_token_id if c.image_token_id >= 0 else c.vocab_size - 1
    llm = hf.causal_lm(
        here / c.llm_path
        if c.llm_path
        else Qwen2Config(
            vocab_size=c.vocab_size,
            hidden_size=c.llm_hidden,
            intermediate_size=4 * c.llm_hidden,
            num_hidden_layers=c.llm_layers,
            num_attention_heads=c.llm_heads,
            num_key_value_heads=c.llm_kv_heads,
            max_position_embeddings=c.max_length,
            attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    )
    vision = hf.vision_tower(
        SiglipVisionConfig(
            hidden_size=c.vision_hidden,
            intermediate_size=4 * c.vision_hidden,
            num_hidden_layers=c.vision_layers,
            num_attention_heads=c.vision_heads,
            image_size=c.image_size,
            patch_size=c.patch_size,
            attention_dropout=0.0,
        ),
        out_dim=llm.hidden_size,
    )
    data = JsonlDataset(
        here / c.data,
        image_spec=vision.image_spec,
        transform=hf.MultimodalTokens(image=(image_token, vision.num_tokens)),
    )
    sections = hf.mllm_sections(llm, vision=vision, image_token_id=image_token)
    return Job(sections, dataset=data)


job.Config = Config
