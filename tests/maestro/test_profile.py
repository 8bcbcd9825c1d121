"""``maestro.profiling.sections``: time and memory against micro-batch size and sequence length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maestro.cli import main
from maestro.config import load
from maestro.costmodel import MeasuredCostModel
from maestro.profiling.sections import _saved_bytes, _truncate, profile_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def kd_profile():
    cfg = load(EXAMPLES / "kd.toml")
    return profile_config(cfg, sizes=(1, 2, 4), draws=1, repeats=1, seq_lens=(32, 64))


def test_rows_sweep_size_and_sequence_length_with_exact_tokens(kd_profile):
    rows = kd_profile["sections"]["student"]["rows"]
    swept = [r for r in rows if "seq_len" in r]
    got = {(r["seq_len"], r["features"]["samples"]) for r in swept}
    assert got == {(L, m) for L in (32, 64) for m in (1.0, 2.0, 4.0)}
    for r in swept:
        assert r["features"]["tokens"] == r["seq_len"] * r["features"]["samples"]
    # the draws at the workload's own lengths are kept too
    assert any("seq_len" not in r for r in rows)


def test_activation_bytes_are_linear_in_samples_and_grow_with_length(kd_profile):
    rows = {
        (r["seq_len"], r["features"]["samples"]): r["activation_bytes"]
        for r in kd_profile["sections"]["student"]["rows"]
        if "seq_len" in r
    }
    for L in (32, 64):
        a1, a2, a4 = rows[(L, 1.0)], rows[(L, 2.0)], rows[(L, 4.0)]
        assert a1 > 0
        # same-length samples: saved activations scale with the batch (padding-free)
        assert a2 == pytest.approx(2 * a1, rel=0.05) and a4 == pytest.approx(4 * a1, rel=0.05)
    # at least linear in length (attention scores add a quadratic part)
    assert rows[(64, 1.0)] >= 1.9 * rows[(32, 1.0)]
    cfg = load(EXAMPLES / "kd.toml")
    w = cfg.model
    # Korthikanti et al. 2022: ~34 * hidden bytes per token and layer at 16 bits (plus the
    # attention scores); fp32 here doubles it. Check the order of magnitude per token.
    per_token = rows[(32, 1.0)] / 32
    layer_floor = 34 * w.student_dim * w.student_layers  # 16-bit, no attention scores
    assert layer_floor <= per_token <= 8 * layer_floor


def test_frozen_section_saves_nothing_and_resident_memory_counts_the_optimizer(kd_profile):
    t = kd_profile["sections"]["teacher"]
    s = kd_profile["sections"]["student"]
    assert all(r["activation_bytes"] == 0 for r in t["rows"])
    assert t["resident_bytes"] > 0 and t["param_bytes"] == 0.0
    # AdamW keeps two fp32 moments: params + grads + 2 moments = 4x the parameter bytes
    assert s["resident_bytes"] == pytest.approx(4 * s["param_bytes"], rel=0.01)
    assert kd_profile["peak_method"] == "accounting"
    assert t["max_micro_batch"] == s["max_micro_batch"] == 4
    for r in s["rows"]:
        assert r["peak_bytes"] == s["resident_bytes"] + r["activation_bytes"]


def test_profile_with_memory_keys_still_fits(kd_profile, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(kd_profile))
    cm = MeasuredCostModel.from_profile(path)
    f = {"samples": 2.0, "tokens": 128.0, "tokens_sq": 2 * 64.0**2}
    assert cm.forward_time("teacher", f) > 0 and cm.backward_time("student", f) > 0


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    import torch

    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def fn():
        h = x @ w  # saves x and w (w is a parameter: skipped)
        return (h * h).sum()  # saves h twice (one storage)

    _, n = _saved_bytes(fn, [w])
    assert n == x.numel() * 4 + 4 * 8 * 4


def test_truncate_clamps_positions():
    import torch

    s = {"id": 3, "tokens": torch.arange(20), "image_pos": 15, "kind": "image"}
    t = _truncate(s, 10, 99)
    assert t["id"] == 99 and t["tokens"].tolist() == list(range(10)) and t["image_pos"] == 9
    assert s["tokens"].numel() == 20  # the original is untouched


def test_profile_cli_seq_lens_and_errors(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["profile", str(EXAMPLES / "kd.toml"), "--out", str(out), "--sizes", "1,2"]
    assert main([*args, "--repeats", "1", "--seq-lens", "32"]) == 0
    text = capsys.readouterr().out
    assert "act KB/token" in text and "peak memory: accounting" in text
    rows = json.loads(out.read_text())["sections"]["student"]["rows"]
    assert {r.get("seq_len") for r in rows} == {None, 32}
    assert main([*args, "--seq-lens", "a,b"]) == 2
    assert "--seq-lens must be comma-separated integers" in capsys.readouterr().err
    assert main([*args, "--seq-lens", "1"]) == 2
    assert "seq_lens must be >= 2" in capsys.readouterr().err


def test_profile_cli_micro_batches_needs_a_run_and_integers(tmp_path, capsys):
    args = ["profile", str(EXAMPLES / "kd.toml"), "--out", str(tmp_path / "p.json")]
    assert main([*args, "--micro-batches", "1,2"]) == 2
    assert "--micro-batches needs --from-run" in capsys.readouterr().err
    assert main([*args, "--from-run", "--micro-batches", "1,x"]) == 2
    assert "--micro-batches must be comma-separated integers" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
