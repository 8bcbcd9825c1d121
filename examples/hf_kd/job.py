"""Distil a Llama-style teacher (about 4x the student's parameters) into a student, from JSONL.

Run it (3 ranks: the frozen teacher on one, two student replicas on the others)::

    python examples/hf_kd/make_data.py          # writes examples/hf_kd/data/train.jsonl
    maestro train examples/hf_kd/hf_kd.toml --nproc 3

``hf_kd.toml`` names this file (``[workload] name = "job.py:job"``, resolved next to the
TOML); its other ``[workload]`` keys fill ``Config`` below. Both models start from random
weights built from configs; point ``teacher_path``/``student_path`` at ``save_pretrained``
directories to distil real checkpoints (read locally, never downloaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import LlamaConfig

from maestro import Job, hf
from maestro.data import JsonlDataset, LengthBucketed


@dataclass
class Config:
    """The ``[workload]`` keys of this job."""

    data: str = "data/train.jsonl"
    """JSONL file of ``{"input_ids": [...]}`` (or ``{"text": ...}`` with ``tokenizer``);
    relative to the TOML's directory."""
    tokenizer: str = ""
    """Local tokenizer directory for records with ``text`` ("" : records hold ``input_ids``)."""
    vocab_size: int = 256
    """Vocabulary shared by teacher and student."""
    max_length: int = 128
    """Longest sequence (longer records are truncated)."""
    teacher_hidden: int = 128
    """Teacher width."""
    teacher_layers: int = 4
    """Teacher blocks."""
    student_hidden: int = 64
    """Student width."""
    student_layers: int = 4
    """Student blocks."""
    heads: int = 4
    """Attention heads of both models."""
    teacher_path: str = ""
    """A local ``save_pretrained`` directory to load the teacher from instead ("" : config)."""
    student_path: str = ""
    """Likewise for the student."""
    alpha: float = 0.5
    """Weight of the KL term: loss = CE + alpha * T^2 * KL(teacher || student) per token."""
    temperature: float = 2.0
    """Distillation temperature T (> 0)."""
    top_k: int = 0
    """Send only the teacher's top-k logits per token (0: all of them)."""
    bucket_by_length: bool = False
    """Group similar lengths into each global batch (``maestro.data.LengthBucketed``)."""

    def validate(self, where: str) -> None:
        for f in ("vocab_size", "max_length", "teacher_hidden", "teacher_layers", "heads"):
            if getattr(self, f) < 1:
                raise ValueError(f"{where}.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("student_hidden", "student_layers"):
            if getattr(self, f) < 1:
                raise ValueError(f"{where}.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("teacher_hidden", "student_hidden"):
            if getattr(self, f) % self.heads:
                raise ValueError(f"{where}.{f} must be a multiple of heads={self.heads}")


def llama(c: Config, hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.heads,
        max_position_embeddings=c.max_length,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def job(config) -> Job:
    """Teacher (frozen) -> student on the JSONL file's token sequences."""
    c: Config = config.model
    here = Path(config.config_dir or ".")
    teacher = hf.causal_lm(
        here / c.teacher_path if c.teacher_path else llama(c, c.teacher_hidden, c.teacher_layers)
    )
    student = hf.causal_lm(
        here / c.student_path if c.student_path else llama(c, c.student_hidden, c.student_layers)
    )
    data = JsonlDataset(
        here / c.data,
        tokenizer=(here / c.tokenizer) if c.tokenizer else None,
        max_length=c.max_length,
    )
    if c.bucket_by_length:
        data = LengthBucketed(data, config.global_batch, config.seed)
    sections = hf.kd_sections(
        teacher, student, alpha=c.alpha, temperature=c.temperature, top_k=c.top_k
    )
    return Job(sections, dataset=data, shuffle=not c.bucket_by_length)


job.Config = Config
