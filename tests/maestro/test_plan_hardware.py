"""``maestro plan RUN.toml --hardware GPU``: a run config's own sections (their modules'
shapes, its data's lengths) priced on an analytical GPU instead of timed on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from maestro.cli import main
from maestro.config import load
from maestro.plan.workload import load_workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_shapes_and_units_come_from_the_modules_and_the_data():
    wl = load_workload(str(EXAMPLES / "mllm_audio.toml"), hardware="h100-sxm")
    assert wl.label == "mllm_audio (H100, analytical)" and wl.config is not None
    sh = wl.cost_model.shapes
    cfg = load(EXAMPLES / "mllm_audio.toml").model
    # the job's [workload] widths and depths, read back from its modules
    assert (sh["llm"].layers, sh["llm"].hidden, sh["llm"].vocab) == (
        cfg.llm_layers,
        cfg.llm_dim,
        cfg.vocab_size,
    )
    assert sh["llm"].unit == "tokens"
    assert (sh["vision"].layers, sh["vision"].hidden, sh["vision"].vocab) == (
        cfg.vision_layers,
        cfg.vision_dim,
        0,
    )
    # each image is image_patches positions; the LLM gets them pooled at its width
    assert sh["vision"].unit == "images"
    assert sh["vision"].tokens_per_unit == cfg.image_patches
    assert sh["vision"].out_bytes_per_unit == cfg.image_patches / cfg.image_pool * cfg.llm_dim * 2
    assert sh["audio"].unit == "audio" and sh["audio"].tokens_per_unit == cfg.audio_frames
    # the batch is the job's own
    assert len(wl.samples) == load(EXAMPLES / "mllm_audio.toml").global_batch


def test_plan_a_run_config_on_an_analytical_gpu(tmp_path, capsys):
    out = tmp_path / "p.toml"
    args = ["plan", str(EXAMPLES / "mllm.toml"), "--hardware", "h100-sxm", "--gpus", "4"]
    assert main([*args, "--simulate-top", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mllm (H100, analytical): 32 samples per step, budget 4 GPUs" in text
    assert "profiling" not in text  # nothing timed on this machine
    assert load(out).global_batch == 32


@pytest.mark.parametrize(
    "args, message",
    [
        (["kd", "--hardware", "h100-sxm"], "--hardware is for run configs"),
        ([str(EXAMPLES / "paper_kd.toml"), "--hardware", "H100"], "--hardware is for run"),
        (
            [str(EXAMPLES / "kd.toml"), "--hardware", "H100", "--profile", "x.json"],
            "--hardware prices on an analytical GPU",
        ),
        ([str(EXAMPLES / "kd.toml"), "--hardware", "tpu-v5"], "unknown GPU preset 'tpu-v5'"),
    ],
)
def test_bad_hardware_use_is_one_line(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
