"""``maestro estimate``: the layout rules, the physics the estimate must show, and one-line
errors for user mistakes."""

from __future__ import annotations

import json

import pytest

from maestro.cli import main
from maestro.estimate import estimate, model, resolve_layout
from maestro.estimate.hardware import hardware
from maestro.estimate.kernels import gemm_time


def test_layout_defaults_and_checks():
    assert resolve_layout(16, tp=2).fsdp == 8
    lay = resolve_layout(16, dp=2, tp=2)
    assert (lay.dp, lay.fsdp, lay.gpus) == (2, 4, 16)
    with pytest.raises(ValueError, match="not divisible by tp"):
        resolve_layout(6, tp=4)
    with pytest.raises(ValueError, match="dp \\* fsdp"):
        resolve_layout(16, dp=2, fsdp=2, tp=2)


def test_narrow_gemms_are_less_efficient():
    hw = hardware("h100-sxm")

    def rate(m, n, k):
        return 2 * m * n * k / gemm_time(m, n, k, hw, 1.0)

    wide = rate(16384, 8192, 8192)
    assert rate(16384, 1152, 1152) < 0.9 * wide  # a SigLIP-wide encoder GEMM
    assert rate(256, 8192, 8192) < 0.9 * wide
    assert wide <= hw.gemm_peak


def test_recompute_trades_time_for_memory():
    kw = dict(gpus=8, seq_len=4096, micro_batch=1)
    none, sel, full = (
        estimate("llama3-8b", recompute=r, **kw) for r in ("none", "selective", "full")
    )
    assert none.step_time < sel.step_time < full.step_time
    assert none.peak_memory > sel.peak_memory > full.peak_memory
    assert (
        full.breakdown["recompute"] > sel.breakdown["recompute"] > 0 == none.breakdown["recompute"]
    )


def test_tp_splits_memory_and_pays_communication():
    one = estimate("llama3-8b", gpus=8, seq_len=4096)
    tp8 = estimate("llama3-8b", gpus=8, seq_len=4096, tp=8)
    assert tp8.memory["activations"] < one.memory["activations"] / 4
    # eager TP (no async TP) exposes its all-gathers and reduce-scatters
    assert tp8.breakdown["exposed_comm"] > 5 * one.breakdown["exposed_comm"]
    assert tp8.tokens_per_s_per_gpu < one.tokens_per_s_per_gpu


def test_interleaving_shrinks_the_bubble():
    kw = dict(gpus=64, seq_len=4096, tp=8, pp=4, global_batch=64, recompute="full")
    plain = estimate("llama3-70b", **kw)
    inter = estimate("llama3-70b", vpp=5, **kw)
    assert plain.breakdown["bubble"] > 0
    assert inter.breakdown["bubble"] < plain.breakdown["bubble"] / 3


def test_fsdp_across_nodes_costs_more_than_inside_one():
    small = estimate("llama3-8b", gpus=8, seq_len=8192, micro_batch=2)
    big = estimate("llama3-8b", gpus=128, seq_len=8192, micro_batch=2)
    assert big.tokens_per_s_per_gpu < small.tokens_per_s_per_gpu
    assert big.memory["state"] < small.memory["state"] / 10


def test_hf_config_is_read(tmp_path):
    cfg = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 1000,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = model(str(tmp_path))
    assert (spec.layers, spec.hidden, spec.kv_heads, spec.ffn, spec.vocab) == (4, 256, 2, 688, 1000)
    assert spec.gated and spec.causal
    e = estimate(str(tmp_path), gpus=1, seq_len=512)
    assert e.step_time > 0 and e.fits


def test_cli_prints_an_estimate_and_json(capsys):
    argv = ["estimate", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--micro-batch", "2"]
    assert main([*argv, "--hardware", "h100-96g-500w"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per GPU" in out and "MFU" in out and "exposed_comm" in out
    assert main(["estimate", "qwen2.5-7b", "--gpus", "16", "--tp", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["tp"] == 2 and d["layout"]["fsdp"] == 8 and d["step_time"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["llama3-8b", "--gpus", "6", "--tp", "4"], "not divisible by tp * pp * cp"),
        (["llama3-70b", "--gpus", "8"], "does not fit: needs"),
        (["llama3-9b"], "unknown model 'llama3-9b'"),
        (["llama3-8b", "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
        (["llama3-8b", "--framework", "jax"], "unknown framework 'jax'"),
        (["llama3-8b", "--tp", "3", "--gpus", "3"], "must divide the model's 32 attention heads"),
        (["llama3-8b", "--gpus", "8", "--global-batch", "12"], "multiple of micro_batch"),
    ],
)
def test_cli_one_line_errors(capsys, argv, message):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err
    if "does not fit" in message:
        assert "GiB over" in err


@pytest.mark.parametrize("tp, recompute", [(1, "none"), (2, "none"), (1, "full"), (4, "full")])
def test_the_planner_prices_a_layout_as_estimate_does(tp, recompute):
    """One model: a Llama-3-8B section on 8 H100s through the planner's cost model (the
    analytical model wrapped in the layout's strategy, as plan/ and sim/ use it) gives the
    step ``maestro estimate`` gives for the same layout."""
    from maestro.costmodel import AnalyticalCostModel, SectionShape, micro_batch_features, preset
    from maestro.plan.tpmodel import SectionStrategy, with_layout

    shape = SectionShape(
        layers=32,
        hidden=4096,
        ffn_hidden=14336,
        vocab=128256,
        heads=32,
        kv_heads=8,
        gated=True,
    )
    fsdp = 8 // tp
    base = AnalyticalCostModel({"m": shape}, gpu=preset("H100"))
    strategy = SectionStrategy(tp=tp, fsdp=fsdp, recompute=recompute == "full")
    cm = with_layout(base, strategies={"m": strategy})
    f = micro_batch_features([{"tokens": 8192}] * 2)
    planner = (
        cm.forward_time("m", f) + cm.backward_time("m", f) + cm.allreduce_time("m", fsdp, True)
    )
    e = estimate("llama3-8b", gpus=8, seq_len=8192, micro_batch=2, tp=tp, recompute=recompute)
    assert planner == pytest.approx(e.step_time, rel=0.03)


def test_the_package_is_the_function():
    import maestro

    e = maestro.estimate("qwen2.5-7b", gpus=8, seq_len=4096)
    assert e.step_time == estimate("qwen2.5-7b", gpus=8, seq_len=4096).step_time


@pytest.mark.parametrize("pp, vpp", [(2, 1), (4, 1), (4, 2), (8, 1)])
def test_the_bubble_is_pp_minus_one_over_vpp_stage_times_plus_the_fill_and_drain(pp, vpp):
    """1F1B's bubble: ``(pp - 1) / vpp`` micro-batches of one stage's compute, plus ``pp - 1``
    hops of the fill's and of the drain's boundary sends (maestro.estimate.pipeline)."""
    from maestro.estimate.pipeline import stage_send_seconds

    spec = model("llama3-8b")  # 32 layers: every pp * vpp here divides them
    mb, seq, gpus, m = 1, 4096, 8 * pp, 16
    est = estimate(
        "llama3-8b", gpus=gpus, seq_len=seq, micro_batch=mb, tp=8, pp=pp, vpp=vpp,
        global_batch=m * mb, recompute="full",
    )  # fmt: skip
    assert est.micro_batches == m
    stage = (est.breakdown["compute"] + est.breakdown["recompute"]) / m  # one mb, one stage
    act = mb * seq * spec.hidden * 2.0  # bf16 boundary activations of one micro-batch
    send = stage_send_seconds(2.0 * act, hardware("h100-sxm"), pp * 8 <= 8)
    assert send > 0
    expected = (pp - 1) / vpp * stage + 2 * (pp - 1) * send
    assert est.breakdown["bubble"] == pytest.approx(expected, rel=1e-9)


def test_logits_shrink_as_one_over_tp_and_the_peak_with_them():
    """The LM head's logits are vocab-parallel: tp ranks each hold 1/tp of them, and the
    peak (the allocations plus the allocator's headroom) carries exactly that drop."""
    from maestro.estimate.framework import framework

    headroom = framework("torchtitan").allocator_headroom
    kw = dict(gpus=8, seq_len=4096, micro_batch=2)
    by_tp = {tp: estimate("llama3-8b", tp=tp, **kw) for tp in (1, 2, 4)}
    for tp, est in by_tp.items():
        assert est.memory["logits"] == pytest.approx(by_tp[1].memory["logits"] / tp, rel=1e-12)
        parts = sum(v for k, v in est.memory.items() if k != "headroom")
        assert est.memory["headroom"] == pytest.approx(headroom * parts, rel=1e-12)
        assert est.peak_memory == pytest.approx(parts + est.memory["headroom"], rel=1e-12)
    # the logits alone take (1 - 1/tp) of their size off the peak, headroom included
    one, two = by_tp[1], by_tp[2]
    drop = (one.memory["logits"] - two.memory["logits"]) * (1 + headroom)
    assert drop > 0.05 * two.peak_memory  # big enough to matter at a 128k vocabulary
    rest = lambda e: sum(v for k, v in e.memory.items() if k not in ("headroom", "logits"))  # noqa: E731
    assert one.peak_memory - two.peak_memory == pytest.approx(
        drop + (rest(one) - rest(two)) * (1 + headroom), rel=1e-9
    )


def test_an_fsdp_group_fits_a_node_only_if_tp_times_cp_of_it_does():
    """8 GPUs at tp = 2: FSDP over 4 ranks inside one node (NVLink). 16 GPUs at tp = 2: FSDP
    over 8 ranks that span two nodes, priced at the network's speed: against the same 16 GPUs
    in one (hypothetical) 16-GPU NVLink domain, only the group's placement differs."""
    import dataclasses

    h100 = hardware("h100-sxm")
    big_node = dataclasses.replace(h100, gpus_per_node=16)
    kw = dict(seq_len=4096, micro_batch=1, tp=2)
    inside = estimate("llama3-8b", gpus=8, **kw)
    across = estimate("llama3-8b", gpus=16, **kw)
    one_domain = estimate("llama3-8b", gpus=16, hardware_name=big_node, **kw)
    assert (inside.layout.fsdp, across.layout.fsdp) == (4, 8)
    assert across.breakdown["exposed_comm"] > 5 * inside.breakdown["exposed_comm"]
    assert across.breakdown["exposed_comm"] > 5 * one_domain.breakdown["exposed_comm"]
    # cp counts too: 4 data ranks x tp 2 x cp 2 = 16 GPUs, two nodes (the K/V ring, cp * tp = 4
    # GPUs, stays inside a node on both sides)
    kw["cp"] = 2
    cp_across = estimate("llama3-8b", gpus=16, **kw)
    cp_one_domain = estimate("llama3-8b", gpus=16, hardware_name=big_node, **kw)
    assert cp_across.layout.fsdp == 4
    assert cp_across.breakdown["exposed_comm"] > 2 * cp_one_domain.breakdown["exposed_comm"]
