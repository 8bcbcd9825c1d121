"""Ready-made sections from Hugging Face factories: distillation and a LLaVA-style MLLM.

``kd_sections`` and ``mllm_sections`` check what can be checked from the configs alone
(vocabularies, widths, placeholder ids) and raise ``ValueError`` when the job is built, on
every rank, before any weight exists. ``MultimodalTokens`` is the matching record transform:
it expands one placeholder token into the tower's number of tokens and masks their labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from maestro.hf.forwards import (
    encoder_forward,
    has,
    kd_student_forward,
    kd_teacher_forward,
    multimodal_cp_split,
    multimodal_lm_forward,
)
from maestro.hf.models import ModelFactory
from maestro.job import IGNORE_INDEX
from maestro.sections import Section

#: the sample key each tower reads
IMAGE_KEY = "pixel_values"
AUDIO_KEY = "input_features"


def kd_sections(
    teacher: ModelFactory,
    student: ModelFactory,
    *,
    alpha: float = 0.5,
    temperature: float = 2.0,
    top_k: int = 0,
) -> list[Section]:
    """A frozen ``teacher`` section feeding a trainable ``student`` (logit distillation).

    Args:
        teacher: ``causal_lm(...)`` of the teacher.
        student: ``causal_lm(...)`` of the student; same vocabulary as the teacher.
        alpha: weight of the KL term in ``CE + alpha * T^2 * KL(p_T || p_S)`` (>= 0).
        temperature: distillation temperature ``T`` (> 0).
        top_k: send only the teacher's top-k logits per token (0: the full distribution).
    """
    vt, vs = teacher.vocab_size, student.vocab_size
    if vt != vs:
        raise ValueError(
            f"KD: teacher vocab_size {vt} != student vocab_size {vs}; logit distillation needs "
            "one shared vocabulary (same tokenizer)"
        )
    if not temperature > 0:
        raise ValueError(f"KD: temperature must be > 0, got {temperature}")
    if alpha < 0:
        raise ValueError(f"KD: alpha must be >= 0, got {alpha}")
    if not 0 <= top_k <= vt:
        raise ValueError(f"KD: top_k must be in [0, vocab_size={vt}], got {top_k}")
    return [
        Section("teacher", teacher, frozen=True, forward=kd_teacher_forward(top_k)),
        Section(
            "student",
            student,
            inputs=["teacher"],
            forward=kd_student_forward(alpha, temperature, teacher="teacher"),
        ),
    ]


def mllm_sections(
    llm: ModelFactory,
    *,
    vision: ModelFactory | None = None,
    audio: ModelFactory | None = None,
    image_token_id: int | None = None,
    audio_token_id: int | None = None,
) -> list[Section]:
    """``vision`` (and/or ``audio``) towers feeding an ``llm`` sink, LLaVA-style.

    A tower runs only on the samples that have its input (``pixel_values`` /
    ``input_features``); the LLM replaces the sample's placeholder tokens with the tower's
    embeddings. Section names: ``vision``, ``audio``, ``llm``.

    Args:
        llm: ``causal_lm(...)``.
        vision: ``vision_tower(..., out_dim=llm.hidden_size)``.
        audio: ``audio_tower(..., out_dim=llm.hidden_size)``.
        image_token_id: the placeholder id of image tokens (needed with ``vision``).
        audio_token_id: the placeholder id of audio tokens (needed with ``audio``).
    """
    towers = {
        "vision": (vision, image_token_id, IMAGE_KEY),
        "audio": (audio, audio_token_id, AUDIO_KEY),
    }
    sections, placeholders = [], {}
    for name, (tower, token_id, key) in towers.items():
        if tower is None:
            continue
        if token_id is None:
            raise ValueError(f"mllm_sections: {name} needs its placeholder token id")
        if not 0 <= token_id < llm.vocab_size:
            raise ValueError(
                f"mllm_sections: {name} placeholder id {token_id} is outside the LLM's "
                f"vocabulary (0..{llm.vocab_size - 1})"
            )
        if tower.out_dim != llm.hidden_size:
            raise ValueError(
                f"mllm_sections: the {name} tower projects to {tower.out_dim} but the LLM's "
                f"hidden_size is {llm.hidden_size}"
            )
        sections.append(Section(name, tower, activates_on=has(key), forward=encoder_forward(key)))
        placeholders[name] = token_id
    if not sections:
        raise ValueError("mllm_sections: give a vision or an audio tower")
    if len(set(placeholders.values())) < len(placeholders):
        raise ValueError("mllm_sections: image_token_id and audio_token_id must differ")
    sections.append(
        Section(
            "llm",
            llm,
            inputs=list(placeholders),
            forward=multimodal_lm_forward(placeholders),
            cp_split=multimodal_cp_split(placeholders),
        )
    )
    return sections


class MultimodalTokens:
    """Record transform: placeholder tokens sized to the towers, ``labels`` masked there.

    A record with ``pixel_values`` must hold the image placeholder id once (expanded here to
    the tower's ``num_tokens`` copies) or exactly ``num_tokens`` times; a record without must
    hold none. Likewise audio. ``labels`` (unless the record has them) are ``input_ids`` with
    ``-100`` at every placeholder, so the default normaliser counts text targets only.

    Args:
        image: ``(placeholder id, tokens per image)``, e.g. ``(id, vision.num_tokens)``.
        audio: ``(placeholder id, tokens per clip)``.
    """

    def __init__(
        self, image: tuple[int, int] | None = None, audio: tuple[int, int] | None = None
    ) -> None:
        self.kinds = {k: v for k, v in ((IMAGE_KEY, image), (AUDIO_KEY, audio)) if v is not None}

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(record)
        ids = torch.as_tensor(out["input_ids"], dtype=torch.long)
        given_labels = "labels" in out
        for key, (token_id, n) in self.kinds.items():
            count = int((ids == token_id).sum())
            if out.get(key) is None:
                if count:
                    raise ValueError(
                        f"{count} placeholder tokens (id {token_id}) but no {key} in the record"
                    )
                continue
            if count == 1 and n != 1:
                (pos,) = (ids == token_id).nonzero()[0].tolist()
                ids = torch.cat([ids[:pos], ids.new_full((n,), token_id), ids[pos + 1 :]])
                if given_labels:
                    raise ValueError(
                        f"a record with labels must already hold {n} placeholder tokens "
                        f"(id {token_id}), it holds 1"
                    )
            elif count != n:
                raise ValueError(
                    f"{key}: {count} placeholder tokens (id {token_id}); need 1 or {n}"
                )
        out["input_ids"] = ids
        if not given_labels:
            mask = torch.zeros_like(ids, dtype=torch.bool)
            for token_id, _ in self.kinds.values():
                mask |= ids == token_id
            out["labels"] = ids.masked_fill(mask, IGNORE_INDEX)
        return out
