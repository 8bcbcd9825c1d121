"""The planner against Optimus' Table 10 (arXiv 2408.03505; bench/optimus_check.py): ViT-3B +
GPT-11B on 8 A100, global batch 16, sequence 2048. Nothing is fitted to the paper; the checks
today's pricing misses are expected failures whose reasons carry the figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "optimus_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("optimus_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def wl(check):
    return check.workload()  # the example's 576 image tokens


@pytest.mark.xfail(
    strict=False,
    reason="the planner prices 8-way FSDP (tp=1, fsdp=8, mbs 1, no recompute) at 2.27 s "
    "against the published 3.20 s (0.71x) at 576 image tokens (2.43 s at 1,024, 2.83 s at "
    "2,048), with the assumed shapes (ViT 64x2048, GPT 36x5120) on an 80 GB A100",
)
def test_fsdp_whole_model_within_15_percent(check, wl):
    p = check.fsdp(wl)
    sp = p.sections["llm"]
    assert (sp.tp, sp.fsdp, sp.pp, p.gpus) == (1, 8, 1, 8)
    assert p.step_time == pytest.approx(check.PUBLISHED["fsdp"], rel=0.15)


def test_megatron_encoder_in_stage_0_within_15_percent(check, wl):
    """Megatron-LM at the assumed tp=4 pp=2, the ViT whole on the first stage and the GPT's
    36 layers cut 18/18 (plan.pipelines): 3.08 s against 3.42 s (0.90x). Before stages came
    from their layers (equal shares of the whole model) it was 2.77 s at tp=2 pp=4."""
    tp, pp = check.MEGATRON_LAYOUTS[0]
    p = check.megatron(wl, tp, pp)
    sp = p.sections["llm"]
    assert (sp.tp, sp.pp, p.gpus) == (tp, pp, 8)
    assert p.step_time == pytest.approx(check.PUBLISHED["megatron"], rel=0.15)


def test_maestro_plan_is_predicted_cheaper_than_fsdp_and_megatron(check, wl):
    """As Optimus' per-module plan measured (2.78 s vs 3.20 and 3.42): 2.21 s against
    2.27 s (FSDP) and 3.08 s (Megatron-LM at tp=4 pp=2), with a whole-model layout (fsdp=4
    tp=2)."""
    m = check.maestro(wl)
    f = check.fsdp(wl)
    tp, pp = check.MEGATRON_LAYOUTS[0]
    g = check.megatron(wl, tp, pp)
    assert m.gpus <= 8
    assert m.gpus * m.step_time < f.gpus * f.step_time
    assert m.gpus * m.step_time < g.gpus * g.step_time


@pytest.mark.xfail(
    strict=False,
    reason="Maestro's plan is the whole-model layout fsdp=4 tp=2, which the baselines' "
    "search finds too: 0.0% saved against the best baseline (the paper: Optimus 2.78 s vs "
    "balanced Megatron-LM 3.04 s, 8.6%)",
)
def test_maestro_saves_against_the_best_whole_model_baseline(check, wl):
    assert check.saving(wl) > 0.0
