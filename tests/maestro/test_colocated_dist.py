"""Colocated groups over real gloo processes equal a single-process step.

A group's members share its ranks; each replica runs every member on its samples, one after
another, outputs in memory (``maestro.runtime.colocated``). Each test trains 3 steps and
compares every member's parameters (saved under its own name) and the losses to
``reference_train``.
"""

import pytest
from dist_cases import KD, MLLM, check_equal

from maestro import config as C
from maestro.runtime import RunOptions, launch
from maestro.runtime.launch import summary_table

pytestmark = pytest.mark.dist


def kd_colocated(scheduler: str, dp: int = 2) -> str:
    text = KD.format(dtype="float64", scheduler=scheduler, top_k=0, student_dp=dp)
    text = text.replace("[sections.teacher]\ndp = 1", f"[sections.teacher]\ndp = {dp}")
    text = text.replace("frozen = true\n", 'frozen = true\ngroup = "kd"\n')
    return text.replace("lr = 0.01\n", 'lr = 0.01\ngroup = "kd"\n')


def mllm_colocated(scheduler: str, dp: int = 2) -> str:
    text = MLLM.format(
        dtype="float64",
        scheduler=scheduler,
        mix="{ text = 0.4, image = 0.6 }",
        audio="",
        llm_dp=dp,
    )
    text = text.replace("[sections.vision]\ndp = 1", f"[sections.vision]\ndp = {dp}")
    text = text.replace("micro_batch_size = 3\n", 'micro_batch_size = 3\ngroup = "vl"\n')
    return text.replace('optimizer = "sgd"\n', 'optimizer = "sgd"\ngroup = "vl"\n')


@pytest.mark.parametrize("scheduler", ["fifo", "wavefront"])
def test_kd_colocated_equals_reference_float64(tmp_path, scheduler):
    """Frozen teacher (mbs 8) and student (mbs 2) share 2 ranks (dp = 2)."""
    cfg = C.loads(kd_colocated(scheduler))
    assert cfg.world_size == 2 and cfg.units() == {"teacher+student": ["teacher", "student"]}
    res = launch(cfg, 2, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["student"])
    assert set(res["busy"]) == {"teacher+student"}


@pytest.mark.parametrize("scheduler", ["fifo", "wavefront"])
def test_mllm_colocated_with_text_only_samples_equals_reference_float64(tmp_path, scheduler):
    """Trainable vision (mbs 3, AdamW) and llm (mbs 2, SGD) share 2 ranks; 40% text-only."""
    cfg = C.loads(mllm_colocated(scheduler))
    assert cfg.world_size == 2
    res = launch(cfg, 2, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["vision", "llm"])


def mllm_audio(groups: dict[str, str], dp: dict[str, int], scheduler: str) -> str:
    """The audio MLLM with ``groups[section]`` and ``dp[section]`` set."""
    text = MLLM.format(
        dtype="float64",
        scheduler=scheduler,
        mix='{ text = 0.4, image = 0.3, "image+audio" = 0.3 }',
        audio="[sections.audio]\ndp = 1\nmicro_batch_size = 2\nlr = 0.01",
        llm_dp=1,
    )
    for name in ("vision", "audio", "llm"):
        head = f"[sections.{name}]\ndp = 1\n"
        extra = f'group = "{groups[name]}"\n' if name in groups else ""
        text = text.replace(head, f"[sections.{name}]\ndp = {dp.get(name, 1)}\n{extra}")
    return text


def test_mllm_mixed_layout_group_feeds_a_section_float64(tmp_path):
    """vision + audio colocated on 1 rank feed a disaggregated llm (dp = 2): 3 ranks."""
    cfg = C.loads(mllm_audio({"vision": "enc", "audio": "enc"}, {"llm": 2}, "wavefront"))
    assert cfg.unit_layout() == {"vision+audio": [0], "llm": [1, 2]}
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["vision", "audio", "llm"])
    # the summary's group row lists each member's own dp and micro-batch size
    rows = {line.split()[0]: line.split()[1:3] for line in summary_table(res).splitlines()[2:]}
    mbs = [cfg.sections[n].micro_batch_size for n in ("vision", "audio", "llm")]
    assert rows == {"vision+audio": ["1,1", f"{mbs[0]},{mbs[1]}"], "llm": ["2", str(mbs[2])]}


def test_mllm_mixed_layout_section_feeds_a_group_float64(tmp_path):
    """A disaggregated vision (1 rank) feeds audio + llm colocated on 2 ranks (dp = 2)."""
    cfg = C.loads(mllm_audio({"audio": "al", "llm": "al"}, {"audio": 2, "llm": 2}, "fifo"))
    assert cfg.unit_layout() == {"vision": [0], "audio+llm": [1, 2]}
    res = launch(cfg, 3, RunOptions(save_dir=str(tmp_path), progress=False), timeout_s=240)
    check_equal(cfg, res, tmp_path, 1e-10, ["vision", "audio", "llm"])


def _kd_profile(path):
    """A synthetic measured profile of the KD test config: linear in tokens, per section."""
    import json

    def rows(fwd, fb):
        out = []
        for n, t in ((1, 10), (2, 20), (4, 40), (8, 80)):
            row = {"features": {"samples": n, "tokens": t, "tokens_sq": t * t / n}}
            row["forward_s"] = fwd * t + 1e-3 * n
            if fb:
                row["forward_backward_s"] = fb * t + 3e-3 * n
            out.append(row)
        return out

    prof = {
        "sections": {
            "teacher": {"rows": rows(4e-4, 0), "bytes_per": {"tokens": 2048.0}},
            "student": {"rows": rows(1e-4, 3e-4), "param_bytes": 4e4, "optimizer_s": 2e-3},
        },
        "link_bw": 1e9,
        "step_overhead_s": 0.01,
    }
    path.write_text(json.dumps(prof))
    return path


def test_a_planned_colocated_layout_is_written_loaded_and_run(tmp_path):
    """Planner = runtime: on 1 GPU only the colocated group fits; its run config trains."""
    from maestro.plan import SearchOptions, plan_maestro
    from maestro.plan.report import plan_toml, read_plan
    from maestro.plan.workload import load_workload

    src = tmp_path / "kd.toml"
    src.write_text(KD.format(dtype="float64", scheduler="fifo", top_k=0, student_dp=1))
    wl = load_workload(str(src), 1, profile=str(_kd_profile(tmp_path / "p.json")))
    opts = SearchOptions(colocate=True, include_monolithic=False, tp_choices=(1,))
    plan = plan_maestro(wl.samples, wl.sections, wl.cost_model, 1, opts)
    assert {sp.group for sp in plan.sections.values()} == {"teacher+student"}
    text = plan_toml(wl, plan)
    _, secs = read_plan(text)
    assert {s.group for s in secs.values()} == {"teacher+student"}
    out = tmp_path / "planned.toml"
    out.write_text(text.replace("steps = 3", "steps = 2"))
    cfg = C.load(out)
    assert cfg.units() == {"teacher+student": ["teacher", "student"]} and cfg.world_size == 1
    assert "--nproc 1" in text
    save = tmp_path / "saved"
    res = launch(cfg, 1, RunOptions(save_dir=str(save), progress=False), timeout_s=240)
    check_equal(cfg, res, save, 1e-10, ["student"])


def test_checkpoints_resume_across_colocated_and_disaggregated_layouts(tmp_path):
    """Step 1 colocated, step 2 disaggregated, step 3 colocated again, from one checkpoint
    directory: member states are saved under their own names, so any layout resumes."""
    colo = mllm_colocated("fifo")
    apart = MLLM.format(
        dtype="float64", scheduler="fifo", mix="{ text = 0.4, image = 0.6 }", audio="", llm_dp=1
    )
    d, out = tmp_path / "ck", tmp_path / "out"

    def run(text, steps, nproc, **kw):
        cfg = C.loads(text.replace("steps = 3", f"steps = {steps}"))
        opts = RunOptions(progress=False, checkpoint_dir=str(d), checkpoint_every=1, **kw)
        return cfg, launch(cfg, nproc, opts, timeout_s=240)

    run(colo, 1, 2)
    _, mid = run(apart, 2, 2, resume=True)
    assert mid["start_step"] == 1
    cfg, res = run(colo, 3, 2, resume=True, save_dir=str(out))
    assert res["start_step"] == 2
    check_equal(cfg, res, out, 1e-10, ["vision", "llm"])


def test_sharded_checkpoint_of_a_group_resumes_disaggregated(tmp_path):
    """``--checkpoint-format sharded``: a group writes one DCP directory per member."""
    d, out = tmp_path / "ck", tmp_path / "out"
    colo = C.loads(kd_colocated("fifo", dp=1).replace("steps = 3", "steps = 1"))
    opts = dict(progress=False, checkpoint_dir=str(d), checkpoint_every=1)
    launch(colo, 1, RunOptions(checkpoint_format="sharded", **opts), timeout_s=240)
    apart = KD.format(dtype="float64", scheduler="fifo", top_k=0, student_dp=1)
    cfg = C.loads(apart.replace("steps = 3", "steps = 2"))
    res = launch(
        cfg,
        2,
        RunOptions(checkpoint_format="sharded", resume=True, save_dir=str(out), **opts),
        timeout_s=240,
    )
    assert res["start_step"] == 1
    check_equal(cfg, res, out, 1e-10, ["student"])
