"""``maestro simulate`` and ``maestro profile`` end to end (CPU, small sizes)."""

from __future__ import annotations

import json
from pathlib import Path

from maestro.cli import main
from maestro.costmodel import MeasuredCostModel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_simulate_scenario_prints_all_schedulers_and_writes_gantts(tmp_path, capsys):
    out = tmp_path / "g.png"
    rc = main(["simulate", "mllm", "--gpus", "16", "--samples", "64", "--gantt", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for name in ("fifo", "wavefront", "monolithic", "monolithic-tokens", "monolithic-balanced"):
        assert f"== {name} " in text
        assert (tmp_path / f"g_{name}.png").stat().st_size > 1000
    assert "wavefront vs fifo:" in text and "util %" in text
    # the three baselines of maestro plan, each named with its sampler
    for name, label in (
        ("monolithic", "conventional (a): data order"),
        ("monolithic-tokens", "careful (b'): token-count-balanced sampler"),
        ("monolithic-balanced", "tuned (b, contains Maestro's cost-aware balancer)"),
    ):
        assert f"== {name} ({label}; schedule" in text
        assert f"wavefront vs {name} ({label}): " in text


def test_simulate_errors_are_one_line(capsys):
    assert main(["simulate", "nope.toml"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["simulate", "kd", "--scheduler", "magic", "--no-gantt"]) == 2
    assert "unknown scheduler" in capsys.readouterr().err
    assert main(["simulate", "kd", "--gpus", "0", "--no-gantt"]) == 2
    assert "--gpus must be >= 1" in capsys.readouterr().err


def test_profile_then_simulate_a_run_config(tmp_path, capsys):
    prof = tmp_path / "p.json"
    cfg = str(EXAMPLES / "kd.toml")
    assert main(["profile", cfg, "--out", str(prof), "--sizes", "1,2", "--repeats", "1"]) == 0
    data = json.loads(prof.read_text())
    assert set(data["sections"]) == {"teacher", "student"}
    assert all(r["forward_s"] > 0 for r in data["sections"]["teacher"]["rows"])
    assert "forward_backward_s" not in data["sections"]["teacher"]["rows"][0]  # frozen
    assert data["sections"]["student"]["optimizer_s"] > 0
    MeasuredCostModel.from_profile(prof)
    capsys.readouterr()
    rc = main(["simulate", cfg, "--profile", str(prof), "--scheduler", "wavefront", "--no-gantt"])
    text = capsys.readouterr().out
    assert rc == 0 and "== wavefront" in text and "teacher" in text
    # the same run with a pipelined teacher: its stages count as ranks, the bubble is named
    staged = tmp_path / "kd_pp.toml"
    staged.write_text(
        Path(cfg).read_text().replace("[sections.teacher]", "[sections.teacher]\npp = 2")
    )
    rc = main(["simulate", str(staged), "--profile", str(prof), "--no-gantt"])
    text = capsys.readouterr().out
    assert rc == 0 and "on 3 ranks" in text and "teacher dp=1 pp=2 mbs=8" in text
    assert "1F1B's fill and drain" in text and "== monolithic-balanced" in text
