"""``maestro plan`` end to end: scenarios, scenario files, run configs, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maestro.cli import main
from maestro.config import load
from maestro.plan.report import read_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _profile(path: Path) -> Path:
    """A synthetic measured profile of examples/kd.toml: linear in tokens, per section."""

    def rows(fwd, fb):
        out = []
        for n, t in ((1, 40), (2, 150), (4, 300), (8, 700)):
            f = {"samples": n, "tokens": t, "tokens_sq": t * t / n}
            row = {"features": f, "forward_s": fwd * t + 1e-3 * n}
            if fb:
                row["forward_backward_s"] = fb * t + 3e-3 * n
            out.append(row)
        return out

    prof = {
        "sections": {
            "teacher": {"rows": rows(4e-4, 0), "bytes_per": {"tokens": 2048.0}},
            "student": {
                "rows": rows(1e-4, 3e-4),
                "param_bytes": 4e6,
                "optimizer_s": 2e-3,
            },
        },
        "link_bw": 1e9,
        "step_overhead_s": 0.01,
    }
    path.write_text(json.dumps(prof))
    return path


@pytest.mark.parametrize("scale", [0, 64])
def test_plan_a_scenario_prints_both_plans_and_writes_a_run_config(tmp_path, capsys, scale):
    # a scenario's --out is a run config naming the Hugging Face job of its shape: at full
    # scale the real widths and the planned GPUs, with --scale-down K one that runs here
    out = tmp_path / "plan.toml"
    args = ["plan", "kd", "--gpus", "16", "--out", str(out), "--simulate-top", "1"]
    rc = main(args + (["--scale-down", str(scale)] if scale else []))
    text = capsys.readouterr().out
    assert rc == 0
    assert "maestro " in text and "GPU-h/M samples" in text
    for label in (
        "conventional (a)",
        "careful (b')",
        "tuned (b, contains Maestro's cost-aware balancer)",
    ):
        assert f"\n{label}  " in text and f"\n{label}: monolithic " in text  # row, layout
    assert "GPUs Maestro needs to match" in text or "GPU-hours saved" in text
    mono, secs = read_plan(out.read_text())
    assert set(secs) == {"teacher", "student"}
    label = "monolithic" if mono else "per-section"
    wrote = next(x for x in text.splitlines() if x.startswith("wrote "))
    assert f"({label} plan, {'scaled down 64x' if scale else 'full scale'}" in wrote
    cfg = load(out)  # maestro train's loader accepts it
    assert cfg.workload == "maestro.hf.scenarios:kd"
    assert cfg.sections["teacher"].frozen and not cfg.sections["student"].frozen
    if scale:
        assert cfg.model.student_hidden == 4096 // 64 and cfg.dtype == "float32"
        assert cfg.world_size <= 4
    else:
        assert cfg.model.student_hidden == 4096 and cfg.model.teacher_hidden == 5120
        if not mono:
            assert cfg.world_size == sum(s.gpus for s in secs.values()) <= 16


def test_plan_a_scenario_file_monolithic_out(tmp_path, capsys):
    scen = tmp_path / "s.toml"
    scen.write_text(
        (EXAMPLES / "paper_mllm.toml").read_text().replace("gpus = 256", "gpus = 8") + "\n"
    )
    scen.write_text(scen.read_text().replace("samples_per_gpu = 8", "samples_per_gpu = 2"))
    out = tmp_path / "mono.toml"
    assert main(["plan", str(scen), "--monolithic", "--out", str(out), "--simulate-top", "1"]) == 0
    mono, secs = read_plan(out.read_text())
    assert mono and set(secs) == {"vision", "audio", "llm"}
    assert len({(s.dp, s.tp, s.micro_batch_size) for s in secs.values()}) == 1
    assert "monolithic" in capsys.readouterr().out
    cfg = load(out)  # the mllm job with its audio tower
    assert cfg.workload == "maestro.hf.scenarios:mllm" and cfg.model.audio_share > 0
    assert "--monolithic --nproc" in out.read_text()


@pytest.mark.parametrize("monolithic", [False, True])
def test_plan_a_run_config_round_trips_through_the_loader(tmp_path, capsys, monolithic):
    prof = _profile(tmp_path / "p.json")
    out = tmp_path / "planned.toml"
    args = ["plan", str(EXAMPLES / "kd.toml"), "--gpus", "4", "--profile", str(prof)]
    args += ["--out", str(out)] + (["--monolithic"] if monolithic else [])
    assert main(args) == 0
    text = capsys.readouterr().out
    cfg = load(out)  # validates
    orig = load(EXAMPLES / "kd.toml")
    assert cfg.model == orig.model and cfg.global_batch == orig.global_batch
    if monolithic:
        assert cfg.sections == orig.sections
        assert "--monolithic --nproc" in out.read_text()
    else:
        assert 2 <= cfg.world_size <= 4
        assert f"--nproc {cfg.world_size}" in out.read_text()
        line = next(x for x in text.splitlines() if x.startswith("maestro:"))
        for n, sc in cfg.sections.items():
            assert f"{n} dp={sc.dp} tp=1 mbs={sc.micro_batch_size}" in line


def test_target_throughput_and_breakdown(capsys):
    rc = main(
        ["plan", "mllm", "--gpus", "16", "--simulate-top", "1", "--breakdown"]
        + ["--target-samples-per-s", "1"]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "target 1 samples/s:" in text and "GPUs" in text
    assert "breakdown:" in text and "skipped modality work" in text
    # what each mechanism buys is measured against the careful baseline (b'), too
    head = next(x for x in text.splitlines() if x.startswith("breakdown:"))
    assert "careful baseline (b')" in head
    row = next(x for x in text.splitlines() if "skipped modality work" in x)
    assert "saved vs (b') with it off:" in row and row.endswith("%")


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope.toml"], "config file not found"),
        (["kd", "--gpus", "0"], "--gpus must be >= 1"),
        (["kd", "--simulate-top", "0"], "--simulate-top must be >= 1"),
        (["kd", "--target-samples-per-s", "-1"], "--target-samples-per-s must be > 0"),
        (["kd", "--out", "/nonexistent/dir/p.toml"], "does not exist"),
        # the 35B teacher and the 7B student with its optimizer state exceed one 80 GB GPU
        (["kd", "--gpus", "1"], "fits"),
        (["kd", "--gpus", "4", "--plot", "x.png", "--plot-gpus", "4,x"], "--plot-gpus"),
        ([str(EXAMPLES / "kd.toml"), "--plot", "x.png"], "--plot sweeps a scenario"),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_scenario_file_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[scenario]\nname = "kd"\nwidth = 3\n')
    assert main(["plan", str(bad)]) == 2
    assert "scenario.width: unknown field" in capsys.readouterr().err
    bad.write_text('[scenario]\nname = "vit"\n')
    assert main(["plan", str(bad)]) == 2
    assert "scenario.name: unknown scenario 'vit'" in capsys.readouterr().err
    bad.write_text("[scenario\n")
    assert main(["plan", str(bad)]) == 2
    assert "invalid TOML" in capsys.readouterr().err


def test_scenario_report_prints_three_baselines_side_by_side(kd16):
    """Conventional (a, data order), careful (b', token-balanced) and tuned (b, Maestro's
    cost-aware balancer) baselines, each with its own saving; the savings are those of the
    printed plans."""
    from maestro.plan import SearchOptions, compare, format_comparison

    c = compare(kd16, 16, SearchOptions(simulate_top=1), match=False)
    assert c.conventional is not None and c.conventional.monolithic
    assert c.careful is not None and c.careful.monolithic
    text = format_comparison("kd", 16, c)
    for label, plan, saving in (
        ("conventional (a)", c.conventional, c.saving_conventional),
        ("careful (b')", c.careful, c.saving_careful),
        ("tuned (b, contains Maestro's cost-aware balancer)", c.monolithic, c.saving),
    ):
        row = next(x for x in text.splitlines() if x.startswith(label + "  "))
        cols = row.removeprefix(label).split()
        assert float(cols[3]) == pytest.approx(plan.gpu_hours_per_million, abs=0.01)
        want = 1 - c.maestro.gpu_hours_per_million / plan.gpu_hours_per_million
        assert saving == pytest.approx(want)
        assert cols[5] == f"{100 * saving:.1f}%"
        assert f"{100 * saving:.1f}% vs {label}" in text
    # a run config's own monolithic candidates are data order or token-count balance (both
    # run in maestro train --monolithic); the three baselines keep their own samplers
    run = compare(kd16, 16, SearchOptions(simulate_top=1, balance_monolithic=False), match=False)
    assert (run.conventional.order, run.careful.order, run.monolithic.order) == (
        "data",
        "tokens",
        "cost",
    )
    if run.maestro.monolithic:
        assert run.maestro.order in ("data", "tokens")
    assert run.conventional.gpu_hours_per_million == pytest.approx(
        c.conventional.gpu_hours_per_million
    )


def test_plot_sweeps_the_budget_for_all_three_plans(tmp_path, capsys):
    png = tmp_path / "kd.png"
    args = ["plan", "kd", "--gpus", "4", "--simulate-top", "1", "--plot", str(png)]
    assert main(args + ["--plot-gpus", "4,8"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("4 ", "8 "))]
    assert [r[0] for r in rows] == ["4", "8"]
    for r in rows:  # maestro never worse than the tuned baseline, tuned never worse than (a)
        maestro, conv, careful, tuned = map(float, r[1:5])
        assert maestro <= tuned + 1e-6 and tuned <= conv + 1e-6
        assert careful > 0 and r[6] == f"{1 - maestro / careful:+.1%}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
