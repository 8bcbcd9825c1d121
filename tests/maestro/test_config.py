"""Config loading and validation: one test per user mistake, each naming the field."""

from pathlib import Path

import pytest

from maestro import config as C

ROOT = Path(__file__).resolve().parents[2]

BASE = """
global_batch = 8
steps = 2
[workload]
name = "kd"
{workload}
[sections.teacher]
dp = 1
micro_batch_size = 4
frozen = true
{teacher}
[sections.student]
dp = 2
micro_batch_size = 2
{student}
{extra}
"""


def cfg_text(workload="", teacher="", student="", extra="", head=""):
    return head + BASE.format(workload=workload, teacher=teacher, student=student, extra=extra)


def test_valid_config_defaults_and_specs():
    cfg = C.loads(cfg_text())
    assert cfg.sections["student"].optimizer == "adamw"
    assert cfg.sections["teacher"].optimizer is None
    specs = cfg.section_specs()
    assert [s.name for s in specs] == ["teacher", "student"]
    assert specs[1].inputs == ("teacher",) and specs[1].dp == 2 and specs[0].frozen
    assert cfg.world_size == 3
    assert cfg.rank_layout() == {"teacher": [0], "student": [1, 2]}
    assert C.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", ["kd.toml", "mllm.toml", "mllm_audio.toml"])
def test_examples_load(name):
    cfg = C.load(ROOT / "examples" / name)
    assert cfg.world_size >= 2


def test_cycle_is_rejected():
    text = cfg_text(teacher='inputs = ["student"]')
    # a frozen teacher reading the student is also a frozen-reads-trainable error; make the
    # teacher trainable so only the cycle is wrong
    text = text.replace("frozen = true", "frozen = false")
    with pytest.raises(ValueError, match=r"sections\.\w+\.inputs: cycle"):
        C.loads(text)


def test_unknown_input_is_rejected():
    with pytest.raises(ValueError, match=r"sections\.student\.inputs: unknown section 'techer'"):
        C.loads(cfg_text(student='inputs = ["techer"]'))


def test_sum_of_dp_must_equal_world_size():
    cfg = C.loads(cfg_text())
    cfg.check_world_size(3)
    with pytest.raises(
        ValueError, match=r"sum of dp is 3 \(teacher=1, student=2\).*world size is 2"
    ):
        cfg.check_world_size(2)


def test_micro_batch_of_zero_is_rejected():
    with pytest.raises(
        ValueError, match=r"sections\.student\.micro_batch_size must be >= 1, got 0"
    ):
        C.loads(cfg_text().replace("micro_batch_size = 2", "micro_batch_size = 0"))


def test_frozen_section_with_optimizer_is_rejected():
    with pytest.raises(ValueError, match=r"sections\.teacher\.optimizer: section is frozen"):
        C.loads(cfg_text(teacher='optimizer = "adamw"'))


def test_dp_zero_is_rejected():
    with pytest.raises(ValueError, match=r"sections\.student\.dp must be >= 1"):
        C.loads(cfg_text().replace("dp = 2", "dp = 0"))


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match=r"sections\.student\.learning_rate: unknown field"):
        C.loads(cfg_text(student="learning_rate = 0.1"))
    with pytest.raises(ValueError, match=r"global_bach: unknown field"):
        C.loads(cfg_text(head="global_bach = 3\n"))


def test_wrong_type_is_rejected():
    with pytest.raises(ValueError, match=r"sections\.student\.dp must be an integer"):
        C.loads(cfg_text().replace("dp = 2", 'dp = "two"'))


def test_unknown_workload_and_section_names():
    with pytest.raises(ValueError, match=r"workload\.name: unknown workload 'gan'"):
        C.loads(cfg_text().replace('name = "kd"', 'name = "gan"'))
    with pytest.raises(ValueError, match=r"sections\.critic: workload 'kd' has no section"):
        C.loads(cfg_text(extra="[sections.critic]\ndp = 1"))
    text = cfg_text().split("[sections.student]")[0]
    with pytest.raises(ValueError, match=r"sections\.student: missing table"):
        C.loads(text)


def test_unknown_optimizer_and_scheduler():
    with pytest.raises(ValueError, match=r"sections\.student\.optimizer: unknown optimizer .lion."):
        C.loads(cfg_text(student='optimizer = "lion"'))
    with pytest.raises(ValueError, match=r"unknown scheduler 'magic'"):
        C.loads(cfg_text(head='scheduler = "magic"\n'))
    with pytest.raises(ValueError, match=r"--monolithic"):
        C.loads(cfg_text(head='scheduler = "monolithic"\n'))


def test_frozen_consumer_of_trainable_producer_is_rejected():
    text = cfg_text().replace("frozen = true", "frozen = false")
    text = text.replace(
        "dp = 2\nmicro_batch_size = 2", "dp = 2\nmicro_batch_size = 2\nfrozen = true"
    )
    with pytest.raises(
        ValueError, match=r"sections\.student\.frozen: a frozen section cannot read"
    ):
        C.loads(text)


def test_workload_fields_are_validated():
    with pytest.raises(ValueError, match=r"workload\.student_dim must be a multiple of heads"):
        C.loads(cfg_text(workload="student_dim = 10\nheads = 4"))
    mllm = """
[workload]
name = "mllm"
mix = { text = 0.5, video = 0.5 }
[sections.vision]
[sections.llm]
"""
    with pytest.raises(ValueError, match=r"workload\.mix: unknown kind 'video'"):
        C.loads(mllm)
    with pytest.raises(ValueError, match=r"workload\.mix: shares must sum to 1"):
        C.loads(mllm.replace("video = 0.5", "image = 0.2"))


def test_mllm_audio_in_mix_adds_audio_section():
    base = '[workload]\nname = "mllm"\nmix = {mix}\n[sections.vision]\n[sections.llm]\n'
    cfg = C.loads(base.format(mix="{ text = 0.5, image = 0.5 }"))
    assert cfg.section_inputs() == {"vision": [], "llm": ["vision"]}
    with pytest.raises(ValueError, match=r"sections\.audio: missing table"):
        C.loads(base.format(mix='{ text = 0.4, image = 0.45, "image+audio" = 0.15 }'))


def test_missing_file_and_bad_toml():
    with pytest.raises(FileNotFoundError):
        C.load("/nonexistent/run.toml")
    with pytest.raises(ValueError, match="invalid TOML"):
        C.loads("steps = = 3")
