"""Hugging Face ``transformers`` models as Maestro sections (no hub access at run time).

Builders return zero-argument module factories (``ModelFactory``: what ``maestro.Section``
takes; its ``config`` is readable without building):

- ``causal_lm(config | dict | local_dir)``: a teacher, student or LLM
  (``AutoModelForCausalLM``; ``LlamaConfig``, ``Qwen2Config``, ...);
- ``vision_tower(SiglipVisionConfig | CLIPVisionConfig | dir, out_dim)``: encoder and a
  LLaVA-style 2-layer projector to the LLM width;
- ``audio_tower(WhisperConfig | dir, out_dim)``: the Whisper encoder and a projector.

Sections and their forwards (``maestro.hf.forwards``): ``kd_sections(teacher, student,
alpha=, temperature=, top_k=)`` (frozen teacher -> student on CE + alpha * T^2 * KL) and
``mllm_sections(llm, vision=, audio=, image_token_id=, audio_token_id=)`` (towers active on
samples with ``pixel_values`` / ``input_features``, spliced into the LLM's
``inputs_embeds`` at placeholder tokens), with the record transform ``MultimodalTokens``.

Example::

    from transformers import LlamaConfig
    from maestro import Job, hf
    from maestro.data import JsonlDataset

    def job(config):
        teacher = hf.causal_lm(LlamaConfig(hidden_size=256, num_hidden_layers=8, ...))
        student = hf.causal_lm("checkpoints/student")         # a save_pretrained directory
        return Job(hf.kd_sections(teacher, student, temperature=2.0),
                   dataset=JsonlDataset("train.jsonl"))
"""

from maestro.hf.forwards import (
    encoder_forward,
    has,
    kd_loss,
    kd_student_forward,
    kd_teacher_forward,
    lm_forward,
    multimodal_lm_forward,
    pad_right,
)
from maestro.hf.jobs import MultimodalTokens, kd_sections, mllm_sections
from maestro.hf.models import ModelFactory, Tower, audio_tower, causal_lm, vision_tower

__all__ = [
    "ModelFactory",
    "MultimodalTokens",
    "Tower",
    "audio_tower",
    "causal_lm",
    "encoder_forward",
    "has",
    "kd_loss",
    "kd_sections",
    "kd_student_forward",
    "kd_teacher_forward",
    "lm_forward",
    "mllm_sections",
    "multimodal_lm_forward",
    "pad_right",
    "vision_tower",
]
