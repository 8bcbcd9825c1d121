"""Scenario files of the user's own sections (``maestro.sim.scenario_file``): parsing, one-line
errors naming file, table and key, token distributions and measured counts, a plan end to
end."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from maestro.cli import main
from maestro.plan.workload import load_workload
from maestro.sim import scenario_file as S

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

MLLM = """
[scenario]
hardware = "H100"
global_batch = 40
gpus = 4
seed = 3

[modalities]
image = 0.5
audio = 0.25

[sections.vision]
model = "vit-0.6b"
runs_on = "image"
tokens = {dist = "uniform", min = 256, max = 1024}
out_ratio = 0.25
attend_within = 256

[sections.audio]
model = "whisper-like"
runs_on = ["audio"]
frozen = true
tokens = 1500

[sections.llm]
model = "qwen2.5-7b"
inputs = ["vision", "audio"]
tokens = {dist = "lognormal", median = 300, sigma = 0.8, max = 4096}
token_budget = 16384
"""


def _write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_parses_sections_modalities_and_costs(tmp_path):
    sf = S.load(_write(tmp_path, MLLM))
    assert [e.name for e in sf.sections] == ["vision", "audio", "llm"]
    assert sf.gpu.name == "H100" and sf.global_batch == 40 and sf.seed == 3
    sc = S.build(sf)
    secs = {s.name: s for s in sc.sections}
    assert secs["llm"].inputs == ("vision", "audio") and secs["audio"].frozen
    assert secs["llm"].token_budget == 16384
    assert sum(s.dp for s in sc.sections) == 4
    # exact shares: 20 image, 10 audio, 10 with no modality (text only)
    kinds = [s.sections for s in sc.samples]
    assert kinds.count(frozenset({"vision", "llm"})) == 20
    assert kinds.count(frozenset({"audio", "llm"})) == 10
    assert kinds.count(frozenset({"llm"})) == 10
    for s in sc.samples:
        text = s.cost["tokens"]
        if "vision" in s.sections:
            v = s.cost["vision:tokens"]
            assert 256 <= v <= 1024
            # attention within 256-token chunks, the LLM reads a quarter of the patches
            full, rest = divmod(int(v), 256)
            assert s.cost["vision:sq"] == full * 256**2 + rest**2
            text -= round(0.25 * v)
        if "audio" in s.sections:
            assert s.cost["audio:tokens"] == 1500
            text -= 1500  # an encoder adds all its positions by default
        assert 1 <= text <= 4096
    shapes = sc.cost_model.shapes
    assert shapes["llm"].unit == "tokens" and shapes["llm"].tp_plan
    assert shapes["vision"].unit == "vision:tokens" and not shapes["vision"].tp_plan
    # the LLM's width: 0.25 bf16 vectors of 3584 per patch
    assert shapes["vision"].out_bytes_per_unit == 0.25 * 3584 * 2
    # the same seed, the same batch
    assert S.build(S.load(_write(tmp_path, MLLM))).samples == sc.samples


def test_kd_alias_shares_the_tokens_key_and_a_config_json_model(tmp_path):
    cfg = {
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "hidden_act": "silu",
    }
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "config.json").write_text(json.dumps(cfg))
    p = _write(
        tmp_path,
        """
[scenario]
hardware = "h100-sxm"
global_batch = 8

[sections.teacher]
model = "qwen2.5-72b"
frozen = true
tokens = 512
out_bytes_per_token = 384

[sections.student]
model = "student"
inputs = ["teacher"]
tokens = "teacher"
""",
    )
    sc = S.build(S.load(p))
    shapes = sc.cost_model.shapes
    assert shapes["teacher"].unit == shapes["student"].unit == "tokens"
    assert shapes["teacher"].out_bytes_per_unit == 384
    st = shapes["student"]
    assert (st.layers, st.hidden, st.ffn_hidden, st.heads, st.kv_heads, st.vocab) == (
        4,
        512,
        1376,
        8,
        2,
        1000,
    )
    assert st.gated
    assert all(s.cost == {"tokens": 512.0} for s in sc.samples)


def test_lognormal_mean_and_max_with_a_fixed_seed():
    p = Path("x.toml")
    spec = S._tokens(
        p, "sections.llm", {"dist": "lognormal", "mean": 800, "sigma": 0.5, "max": 10**6}
    )
    xs = S.sample_tokens(spec, 20000, seed=7)
    assert statistics.fmean(xs) == pytest.approx(800, rel=0.03)
    assert statistics.median(xs) == pytest.approx(800 * 2.718281828 ** (-0.125), rel=0.03)
    # clipped at max: no draw above it, and a long tail piles up there
    clipped = S._tokens(
        p, "sections.llm", {"dist": "lognormal", "mean": 800, "sigma": 1.0, "max": 2000}
    )
    ys = S.sample_tokens(clipped, 20000, seed=7)
    assert max(ys) == 2000 and min(ys) >= 1
    assert statistics.fmean(ys) < 800
    assert S.sample_tokens(clipped, 50, seed=7) == S.sample_tokens(clipped, 50, seed=7)


def test_tokens_from_measures_a_jsonl_field(tmp_path):
    rows = [
        {"n": 10, "text": "abcd", "ids": [1, 2, 3]},
        {"n": 20.0, "text": "ab"},
        {"other": 1},  # no field: skipped
        {"n": 30, "text": "abcdefgh", "ids": []},
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    base = '[scenario]\nhardware = "H100"\nglobal_batch = 64\n[sections.llm]\nmodel = "llm-7b"\n'
    sf = S.load(_write(tmp_path, base + 'tokens_from = "data.jsonl:n"\n'))
    assert sf.sections[0].tokens.values == (10, 20, 30)
    got = {s.cost["tokens"] for s in S.build(sf).samples}
    assert got == {10.0, 20.0, 30.0}  # 64 draws with replacement reach every line
    sf = S.load(_write(tmp_path, base + 'tokens_from = "data.jsonl:text"\ntokens_scale = 2.5\n'))
    assert sf.sections[0].tokens.values == (10, 5, 20)  # string length x 2.5
    sf = S.load(_write(tmp_path, base + 'tokens_from = "data.jsonl:ids"\n'))
    assert sf.sections[0].tokens.values == (3, 1)  # list length (an empty one counts as 1)


def test_sections_reading_one_file_draw_the_same_line(tmp_path):
    # each sample's vision and text counts come from one line (a line without the image
    # field gives the next line's)
    rows = [{"img": 100 * k, "text": 10 * k} for k in range(1, 9)] + [{"text": 5}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    p = _write(
        tmp_path,
        """
[scenario]
hardware = "H100"
global_batch = 50
[sections.vision]
model = "vit-0.6b"
tokens_from = "d.jsonl:img"
out_ratio = 0
[sections.llm]
model = "llm-7b"
inputs = ["vision"]
tokens_from = "d.jsonl:text"
""",
    )
    samples = S.build(S.load(p)).samples
    pairs = {(s.cost["vision:tokens"], s.cost["tokens"]) for s in samples}
    assert all(t == v / 10 or (t == 5 and v == 100) for v, t in pairs), pairs
    assert len(pairs) >= 5


GOOD = '[scenario]\nhardware = "H100"\nglobal_batch = 8\n'
LLM = '[sections.llm]\nmodel = "qwen2.5-7b"\ntokens = 100\n'


@pytest.mark.parametrize(
    "text, where",
    [
        (GOOD + LLM + "[bogus]\nx = 1\n", "[top level] bogus: unknown key"),
        (GOOD.replace("global_batch", "globl_batch") + LLM, "[scenario] globl_batch: unknown"),
        ('[scenario]\nhardware = "H100"\n' + LLM, "[scenario] global_batch: required"),
        (GOOD.replace('"H100"', '"tpu"') + LLM, "[scenario] hardware: unknown GPU preset 'tpu'"),
        (GOOD.replace("8", "0") + LLM, "[scenario] global_batch: must be an integer >= 1"),
        (GOOD + 'name = "kd"\n' + LLM, "[scenario] name: names a built-in scenario"),
        (GOOD + LLM + "widht = 3\n", "[sections.llm] widht: unknown key"),
        (
            GOOD + LLM.replace("qwen2.5-7b", "gpt-9"),
            "[sections.llm] model: 'gpt-9' is not a preset",
        ),
        (GOOD + '[sections.llm]\nmodel = "llm-7b"\n', "[sections.llm] tokens: give exactly one"),
        (
            GOOD + LLM.replace("100", '{dist = "lognormal", mean = 100, sigma = -1, max = 9}'),
            "[sections.llm] tokens.sigma: must be a number >= 0",
        ),
        (
            GOOD + LLM.replace("100", '{dist = "lognormal", mean = 100, sigma = 1}'),
            "[sections.llm] tokens.max: required for lognormal",
        ),
        (
            GOOD + LLM.replace("100", '{dist = "lognormal", mean = 0, sigma = 1, max = 9}'),
            "[sections.llm] tokens.mean: must be a number > 0",
        ),
        (
            GOOD + LLM.replace("100", '{dist = "poisson", mean = 3}'),
            "[sections.llm] tokens: dist must be one of lognormal, uniform",
        ),
        (
            GOOD + LLM.replace("100", '{dist = "uniform", min = 9, max = 3}'),
            "[sections.llm] tokens.max: 3 < min 9",
        ),
        (GOOD + LLM.replace("100", '"vision"'), "[sections.llm] tokens: 'vision' is neither"),
        (
            GOOD + LLM.replace("tokens = 100", 'tokens_from = "nope.jsonl:n"'),
            "[sections.llm] tokens_from: data file",
        ),
        (
            GOOD + LLM.replace("tokens = 100", 'tokens_from = "nope.jsonl"'),
            '[sections.llm] tokens_from: must be "FILE.jsonl:FIELD"',
        ),
        (GOOD + LLM + 'inputs = ["vision"]\n', "[sections.llm] inputs: unknown section 'vision'"),
        (
            GOOD
            + '[sections.a]\nmodel = "vit-0.6b"\ntokens = 4\ninputs = ["b"]\n'
            + '[sections.b]\nmodel = "vit-0.6b"\ntokens = 4\ninputs = ["a"]\n',
            "form a cycle",
        ),
        (GOOD + "[modalities]\nimage = 1.5\n" + LLM, "[modalities] image: share must be in [0, 1]"),
        (GOOD + "[modalities]\nimage = -0.1\n" + LLM, "[modalities] image: must be a number >= 0"),
        (
            GOOD + "[modalities]\nimage = 0.7\naudio = 0.6\n" + LLM,
            "[modalities]: shares sum to 1.3 > 1",
        ),
        (GOOD + LLM + 'runs_on = "video"\n', "[sections.llm] runs_on: unknown modality 'video'"),
        (
            GOOD + "[modalities]\nimage = 0.5\n" + LLM + 'runs_on = "image"\n',
            "[modalities]: samples of no modality runs no section",
        ),
        (
            GOOD
            + "[modalities]\nimage = 0.5\n"
            + '[sections.vision]\nmodel = "vit-0.6b"\ntokens = 4\n'
            + LLM
            + 'inputs = ["vision"]\nruns_on = "image"\n',
            "[sections.vision] runs_on: runs on samples of no modality but none of its "
            "consumers (llm) does",
        ),
    ],
)
def test_every_mistake_is_one_line_naming_file_table_and_key(tmp_path, capsys, text, where):
    p = _write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        S.load(p)
    msg = str(e.value)
    assert where in msg and "\n" not in msg
    assert str(p) in msg
    # the CLI prints it on one line
    assert main(["plan", str(p)]) == 2
    err = capsys.readouterr().err
    assert where in err and err.count("\n") == 1


def test_bad_config_json_names_the_file(tmp_path):
    (tmp_path / "m.json").write_text('{"hidden_size": 64}')
    p = _write(tmp_path, GOOD + '[sections.llm]\nmodel = "m.json"\ntokens = 8\n')
    with pytest.raises(ValueError, match=r"\[sections.llm\] model: .*m.json: .*num_hidden_layers"):
        S.load(p)


def test_old_scenario_keys_still_work_and_new_keys_need_sections(tmp_path):
    wl = load_workload(str(EXAMPLES / "paper_kd.toml"), 4)
    assert wl.scenario is not None and wl.scenario.name == "kd"
    p = _write(tmp_path, GOOD)
    with pytest.raises(ValueError, match=r"\[scenario\] hardware: .*needs \[sections.NAME\]"):
        load_workload(str(p))


def test_plan_a_tiny_scenario_file_end_to_end(tmp_path, capsys):
    p = _write(
        tmp_path,
        """
[scenario]
hardware = "H100"
global_batch = 16
gpus = 4

[modalities]
image = 0.5

[sections.vision]
model = "vit-0.6b"
runs_on = "image"
tokens = 256

[sections.llm]
model = "qwen2.5-7b"
inputs = ["vision"]
tokens = {dist = "lognormal", mean = 512, sigma = 0.7, max = 2048}
""",
    )
    assert main(["plan", str(p), "--gpus", "4", "--simulate-top", "1"]) == 0
    out = capsys.readouterr().out
    assert "s (H100, scenario file): 16 samples per step, budget 4 GPUs" in out
    for row in ("maestro", "conventional (a)", "careful (b')", "tuned (b"):
        assert row in out
    # --out writes run configs of jobs; a scenario file's sections have none
    assert main(["plan", str(p), "--out", str(tmp_path / "o.toml")]) == 2
    assert "--out" in capsys.readouterr().err


def test_the_optimus_example_loads(tmp_path):
    sc = S.build(S.load(EXAMPLES / "optimus_table10.toml"))
    assert len(sc.samples) == 16 and sum(s.dp for s in sc.sections) == 8
    shapes = sc.cost_model.shapes
    assert shapes["vision"].params == pytest.approx(3.2e9, rel=0.05)
    assert shapes["llm"].params == pytest.approx(11.6e9, rel=0.05)
    assert all(s.cost["tokens"] == 2048 for s in sc.samples)


def test_simulate_reads_scenario_files(capsys):
    args = ["--no-gantt", "--scheduler", "wavefront"]
    assert main(["simulate", str(EXAMPLES / "optimus_table10.toml"), *args]) == 0
    assert "optimus-table10 (A100, scenario file): 16 samples on 8 ranks" in capsys.readouterr().out
    # a built-in scenario's file, too (its [scenario] table names it)
    assert main(["simulate", str(EXAMPLES / "paper_kd.toml"), "--gpus", "8", *args]) == 0
    assert "16 samples" not in capsys.readouterr().out


def test_simulate_takes_the_heavy_scenarios_its_help_names(capsys):
    args = ["--gpus", "4", "--samples", "8", "--no-gantt", "--scheduler", "wavefront"]
    assert main(["simulate", "mllm-vl", *args]) == 0
    assert "mllm-vl: 8 samples on 4 ranks" in capsys.readouterr().out


def test_a_decoder_on_some_samples_shares_the_tokens_key(tmp_path):
    # a teacher distilling on half the samples, with the student's counts there: causal,
    # priced on the batch's tokens like the student
    p = _write(
        tmp_path,
        GOOD
        + "[modalities]\nkd = 0.5\n"
        + '[sections.teacher]\nmodel = "llm-7b"\nfrozen = true\nruns_on = "kd"\ntokens = 64\n'
        + '[sections.student]\nmodel = "llm-7b"\ninputs = ["teacher"]\ntokens = 64\n',
    )
    sc = S.build(S.load(p))
    assert {sh.unit for sh in sc.cost_model.shapes.values()} == {"tokens"}
    assert sorted(len(s.sections) for s in sc.samples) == [1] * 4 + [2] * 4
