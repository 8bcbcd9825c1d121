"""The planner gives ``tp > 1`` only to sections the runtime can split tensor-parallel.

The rule is the runtime's own (``maestro.parallel.tp.tp_refusal``, asked of a module by
``maestro.parallel.apply.module_tp_refusal``): a section whose module has no transformer
block with a TP plan (the scenarios' SigLIP and Whisper towers) runs at ``tp = 1``, alone or
in a colocated group, while the others keep their choice of degree.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from torch import nn

import maestro.plan.search as search
from maestro.cli import main
from maestro.config import load
from maestro.costmodel import GPU_PRESETS, AnalyticalCostModel, SectionShape, splits_tp
from maestro.parallel.apply import module_tp_refusal, transformer_blocks
from maestro.parallel.tp import _check_divisible, tp_refusal
from maestro.plan import SearchOptions, plan_maestro, plan_toml
from maestro.plan.problem import _group_options, _Problem, _section_options, _units
from maestro.plan.workload import ScenarioSpec, scenario_tp_plans, scenario_workload
from maestro.schedule.types import SampleInfo, SectionSpec
from maestro.sim.scenarios import SHAPES

#: an encoder without a TP plan feeding an LLM too large for one GPU unsharded
ENC = SectionShape(
    layers=8, hidden=1024, unit="images", tokens_per_unit=256, out_bytes_per_unit=1e5
)
SECTIONS = [
    SectionSpec("enc", micro_batch_size=8),
    SectionSpec("llm", inputs=("enc",), micro_batch_size=4, token_budget=8192),
]
SAMPLES = [
    SampleInfo(i, frozenset({"enc", "llm"}), {"tokens": 300 + 37 * (i % 9), "images": 1})
    for i in range(32)
]
#: no FSDP and no ZeRO-1: the 7B LLM (~119 GB of state) must be split by tp to fit 72 GB
# (no pipeline stages either: they shard the state too)
NO_SHARDING = {
    "fsdp_choices": (1,),
    "zero1": False,
    "include_monolithic": False,
    "pp_choices": (1,),
}


def _model(enc_splits: bool) -> AnalyticalCostModel:
    return AnalyticalCostModel(
        {"enc": replace(ENC, tp_plan=enc_splits), "llm": SHAPES["llm"]}, gpu=GPU_PRESETS["H100"]
    )


def _record_candidates(monkeypatch) -> list[dict]:
    """Every combination the search ranks: ``unit -> (members, tp)``."""
    seen: list[dict] = []
    real = search._allocate

    def spy(p, units, combo):
        seen.append({u: (units[u].members, o.tp) for u, o in combo.items()})
        return real(p, units, combo)

    monkeypatch.setattr(search, "_allocate", spy)
    return seen


@pytest.mark.parametrize("colocate", [False, True])
def test_a_section_without_a_tp_plan_gets_tp_1_in_every_candidate(monkeypatch, colocate):
    cm = _model(enc_splits=False)
    assert not splits_tp(cm, "enc") and splits_tp(cm, "llm")
    opts = SearchOptions(colocate=colocate, simulate_top=1, **NO_SHARDING)
    p = _Problem(SAMPLES, SECTIONS, cm, 16, opts)
    enc = _section_options(p, "enc")
    assert enc and {o.tp for o in enc} == {1}
    assert {o.tp for o in _section_options(p, "llm")} >= {2, 4}  # llm still splits
    # a colocated group with the encoder has only tp = 1 grids
    member = {n: _section_options(p, n, standalone=False) for n in p.order}
    (u,) = _units(p, [("enc", "llm")]).values()
    assert all(o.tp == 1 for o in _group_options(p, u, member))

    seen = _record_candidates(monkeypatch)
    plan = plan_maestro(SAMPLES, SECTIONS, cm, 16, opts)
    assert seen
    for combo in seen:
        for members, tp in combo.values():
            assert "enc" not in members or tp == 1, combo
    assert plan.sections["enc"].tp == 1
    assert plan.sections["llm"].tp > 1  # it cannot fit otherwise
    assert any(tp > 1 for c in seen for m, tp in c.values() if m == ("llm",))


def test_the_same_encoder_with_a_tp_plan_may_split():
    # the control: with the flag on, the planner does consider tp > 1 for the encoder
    p = _Problem(SAMPLES, SECTIONS, _model(enc_splits=True), 16, SearchOptions(**NO_SHARDING))
    assert {o.tp for o in _section_options(p, "enc")} > {1}


def test_forcing_tp_on_a_section_without_a_tp_plan_is_a_one_line_error():
    opts = SearchOptions(tp_choices=(2, 4), **NO_SHARDING)
    with pytest.raises(ValueError) as e:
        plan_maestro(SAMPLES, SECTIONS, _model(enc_splits=False), 16, opts)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("section 'enc': its module has no transformer block to split")
    assert "tp_choices are [2, 4]" in msg
    # with a TP plan the same choices are fine
    got = plan_maestro(SAMPLES, SECTIONS, _model(enc_splits=True), 16, opts)
    assert got.sections["enc"].tp in (2, 4)


def test_writing_a_plan_with_tp_on_such_a_section_names_it():
    wl = scenario_workload(ScenarioSpec(name="mllm", gpus=16, samples_per_gpu=1))
    opts = SearchOptions(simulate_top=1, include_monolithic=False)
    plan = plan_maestro(wl.samples, wl.sections, wl.cost_model, 16, opts)
    assert plan.sections["vision"].tp == 1
    plan.sections["vision"] = replace(plan.sections["vision"], tp=2)
    with pytest.raises(ValueError) as e:
        plan_toml(wl, plan, 64)
    assert str(e.value).startswith(
        "sections.vision.tp = 2: the section's module has no transformer block to split"
    )
    assert "\n" not in str(e.value)


def test_the_runtime_rule_is_the_one_the_planner_reads():
    # apply_tp's refusal, as a predicate
    assert tp_refusal([], "sections.vision").startswith(
        "sections.vision.tp: the section's module has no transformer block to split; declare"
    )
    assert module_tp_refusal(nn.Sequential(nn.Linear(4, 4)), "sections.x") is not None
    # the scenarios' Hugging Face encoders have no TP plan, their LLMs do; the analytical
    # shapes declare the same (their fallback without transformers)
    pytest.importorskip("transformers")
    for name, want in (
        ("kd", {"teacher": True, "student": True}),
        ("mllm-audio", {"vision": False, "audio": False, "llm": True}),
    ):
        assert scenario_tp_plans(name) == want
        assert {n: SHAPES[n].tp_plan for n in want} == want
        cm = scenario_workload(ScenarioSpec(name=name, gpus=16, samples_per_gpu=1)).cost_model
        assert {n: splits_tp(cm, n) for n in want} == want


def _check_runtime_accepts(path) -> dict[str, int]:
    """``section -> tp`` of the config at ``path``; every section with ``tp > 1`` passes the
    runtime's TP checks (``tp_refusal`` and the degree's divisibility) on its real module."""
    cfg = load(path)
    with torch.device("meta"):
        graph = cfg.job().graph()
    tps = {n: sc.tp for n, sc in cfg.sections.items()}
    for sec in graph:
        tp, where = tps[sec.name], f"sections.{sec.name}"
        if tp > 1:
            assert module_tp_refusal(sec.module, where) is None
            for blk in transformer_blocks(sec.module):
                _check_divisible(blk, tp, where)
    return tps


def test_maestro_plan_mllm_colocate_scale_down_writes_a_config_the_runtime_accepts(
    tmp_path, capsys, monkeypatch
):
    # the reported command line on 16 GPUs (256 take minutes to plan), searched without FSDP
    # and ZeRO-1 so that the LLM needs tp > 1: the colocated [vision+llm] group at tp = 4 the
    # planner used to pick is written with vision at tp = 2, which maestro train refuses
    pytest.importorskip("transformers")
    import maestro.plan

    no_sharding = functools.partial(SearchOptions, fsdp_choices=(1,), zero1=False)
    monkeypatch.setattr(maestro.plan, "SearchOptions", no_sharding)
    out = tmp_path / "m.toml"
    args = ["plan", "mllm", "--gpus", "16", "--colocate", "--out", str(out)]
    assert main(args + ["--scale-down", "64", "--simulate-top", "1"]) == 0
    assert "wrote " in capsys.readouterr().out
    tps = _check_runtime_accepts(out)
    assert tps["vision"] == 1


@pytest.mark.parametrize("colocate", [True, False])
def test_a_256_gpu_mllm_plan_written_scaled_down_passes_the_runtime_tp_check(tmp_path, colocate):
    # the planner half of `maestro plan mllm --gpus 256 [--colocate] --scale-down 64` on a
    # smaller batch; without FSDP the LLM needs tp > 1, so the check has a section to check
    pytest.importorskip("transformers")
    wl = scenario_workload(ScenarioSpec(name="mllm", gpus=256, samples_per_gpu=1))
    opts = SearchOptions(colocate=colocate, simulate_top=1, **NO_SHARDING)
    plan = plan_maestro(wl.samples, wl.sections, wl.cost_model, 256, opts)
    assert plan.sections["vision"].tp == 1 and plan.sections["llm"].tp > 1
    out = tmp_path / "m.toml"
    out.write_text(plan_toml(wl, plan, 64))
    tps = _check_runtime_accepts(out)
    assert tps["vision"] == 1 and tps["llm"] == 2
