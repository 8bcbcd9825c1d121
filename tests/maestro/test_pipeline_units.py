"""Pipeline stages (``pp``) in one process: the stage cut itself, its order and its errors.

The cut is checked against the whole module: stage 0's forward, then stage 1's on the
hidden state stage 0 returned (detached, as it crosses ranks), give the whole module's
outputs, and chaining the stages' backwards by hand gives every parameter the whole
module's gradient (float64). The runtime's exactness on real ranks is
``test_pipeline_dist.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from maestro import Parallelism, Section
from maestro import config as C
from maestro.parallel.mesh import SectionLayout
from maestro.parallel.pipeline import (
    HIDDEN,
    SkippedBlock,
    make_stage,
    merge_optimizer_states,
    stage_bounds,
    stage_optimizer_state,
)
from maestro.runtime.pipeline import order
from maestro.workloads.layers import Decoder


def _tokens(seed=0, n=3, t=7, vocab=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g)


def _lm_forward(module, samples, inputs):
    ids = torch.stack([s["tokens"] for s in samples])  # (B, T)
    out = module(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits  # (B, T, V)
    return [
        {"loss": F.cross_entropy(lg[:-1], s["tokens"][1:], reduction="sum")}
        for lg, s in zip(logits, samples)
    ]


def _run_staged(build, parallel, pp, samples):
    """Per stage: (section, stage, outputs), running stage s on stage s-1's hidden state
    (detached, requiring grad, as received from another rank)."""
    out, hidden = [], None
    for s in range(pp):
        torch.manual_seed(0)
        sec = Section("lm", build(), forward=_lm_forward, parallel=parallel)
        st = make_stage(sec, s, pp, "sections.lm")
        st.install_hooks()
        st.refresh(sec.module)
        incoming = None
        if s > 0:
            incoming = hidden.detach().requires_grad_(True)
            st.incoming = incoming
        outs = sec.run(samples, {})
        if s < pp - 1:
            hidden = outs[0][HIDDEN]
        out.append((sec, st, outs, incoming))
    return out


def _check_equal_to_whole(build, parallel, pp):
    samples = [{"id": i, "tokens": t} for i, t in enumerate(_tokens())]
    torch.manual_seed(0)
    whole = Section("lm", build(), forward=_lm_forward, parallel=parallel)
    ref = whole.run(samples, {})
    torch.stack([o["loss"] for o in ref]).sum().backward()
    ref_grads = {n: p.grad for n, p in whole.module.named_parameters()}

    stages = _run_staged(build, parallel, pp, samples)
    last = stages[-1][2]
    for a, b in zip(last, ref):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-12, atol=0)
    # backward by hand, last stage first, the hidden state's gradient passed back
    grad = None
    for s in reversed(range(pp)):
        sec, st, outs, incoming = stages[s]
        if s == pp - 1:
            torch.stack([o["loss"] for o in outs]).sum().backward()
        else:
            torch.autograd.backward([outs[0][HIDDEN]], [grad])
        if incoming is not None:
            grad = incoming.grad
    seen = set()
    for sec, st, _, _ in stages:
        shared = {id(p) for p in st.shared_params}
        for n, p in sec.module.named_parameters():
            if id(p) in shared:
                continue  # summed over the stages by the runtime (below)
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-12, atol=1e-15)
            seen.add(n)
    # the shared parameters' gradients, summed over the stages, are the whole module's
    shared_names = {n for n, p in stages[0][0].module.named_parameters()} - seen
    for n in shared_names:
        total = None
        for sec, _, _, _ in stages:
            g = dict(sec.module.named_parameters())[n].grad
            if g is not None:
                total = g if total is None else total + g
        torch.testing.assert_close(total, ref_grads[n], rtol=1e-12, atol=1e-15)
    assert seen | shared_names == set(ref_grads)
    return stages


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("pp", [2, 3])
def test_maestro_decoder_cut_equals_whole(pp):
    stages = _check_equal_to_whole(lambda: Decoder(32, 16, 3, 2, 16), None, pp)
    # blocks of other stages are parameter-free placeholders; the counts add up
    owned = [len(st.blocks) for _, st, _, _ in stages]
    assert sum(owned) == 3 and max(owned) - min(owned) <= 1
    sec0 = stages[0][0]
    assert isinstance(sec0.module.blocks[-1], SkippedBlock)
    assert not list(sec0.module.blocks[-1].parameters())


def test_hugging_face_llama_cut_equals_whole():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,  # the tied weight's gradient comes from both ends
    )
    cfg._attn_implementation = "eager"
    _check_equal_to_whole(lambda: LlamaForCausalLM(cfg), None, 2)


class MyBlock(nn.Module):
    """A user's block called with keyword arguments and returning a tuple."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, hidden_states, scale=1.0):
        return (hidden_states + torch.tanh(self.lin(hidden_states)) * scale, "aux")


class MyModel(nn.Module):
    def __init__(self, vocab=32, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.stack = nn.ModuleList(MyBlock(d) for _ in range(4))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.stack:
            h = blk(hidden_states=h, scale=0.5)[0]
        return self.out(h)


def test_user_blocks_by_keyword_and_tuple_cut_equals_whole():
    _check_equal_to_whole(MyModel, Parallelism(blocks=[MyBlock]), 2)


def test_stage_bounds_and_orders():
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # 1F1B: the first of 3 stages warms up with 2 forwards, the last alternates at once
    assert order(3, 0, 4, sink=True, frozen=False) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)
    ]  # fmt: skip
    assert order(3, 2, 2, sink=True, frozen=False) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    # a producer's backwards wait for its consumers: every forward first
    assert order(2, 0, 2, sink=False, frozen=False) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert order(2, 1, 3, sink=True, frozen=True) == [("F", 0), ("F", 1), ("F", 2)]
    for pp, s, m in [(2, 0, 1), (4, 1, 6), (3, 0, 0)]:
        got = order(pp, s, m, sink=True, frozen=False)
        assert sorted(got) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
        # a micro-batch's backward never precedes its forward
        assert all(got.index(("F", k)) < got.index(("B", k)) for k in range(m))


def test_layout_with_stages():
    lay = SectionLayout("s", tuple(range(10, 18)), dp=1, fsdp=2, tp=2, pp=2)
    # replica 0: stage 0 = 10, 11 (tp), stage 1 = 12, 13; replica 1: 14..17
    assert lay.replica_ranks(1) == [14, 15, 16, 17]
    assert lay.leader(0) == 12 and lay.input_grad_leader(0) == 10
    assert lay.output_ranks(1) == [16, 17]
    assert [lay.stage_of(r) for r in (10, 11, 12, 13, 14)] == [0, 0, 1, 1, 0]
    assert lay.replica_of(13) == 0 and lay.replica_of(14) == 1
    assert lay.stage_layout(1).ranks == (12, 13, 16, 17)
    assert lay.pipeline_ranks(1, 1) == [15, 17]
    assert lay.coordinate(15) == (0, 1, 1)
    assert lay.dp_peers(13) == [13, 17]


def test_optimizer_state_merges_and_splits_back():
    from maestro.parallel.pipeline import Stage

    full_names = ["emb", "b0", "b1", "head"]
    parts = []
    for names in (["emb", "b0", "head"], ["emb", "b1", "head"]):
        st = Stage(0, 2, [], (0, 1), [], full_names, names)
        gidx = st.global_index()
        sd = {
            "state": {i: {"exp_avg": torch.tensor([float(g)])} for i, g in enumerate(gidx)},
            "param_groups": [{"lr": 0.1, "params": list(range(len(names)))}],
        }
        parts.append((gidx, sd, st))
    merged = merge_optimizer_states([(g, sd) for g, sd, _ in parts], 4)
    assert merged["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert [float(merged["state"][i]["exp_avg"]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    back = stage_optimizer_state(parts[1][2], merged)
    assert [float(back["state"][i]["exp_avg"]) for i in range(3)] == [0.0, 2.0, 3.0]


def _section(pp, build, forward=_lm_forward, parallel=None):
    torch.manual_seed(0)
    sec = Section("lm", build(), forward=forward, parallel=parallel)
    return make_stage(sec, pp[0], pp[1], "sections.lm"), sec


def test_too_few_blocks_is_one_line():
    with pytest.raises(ValueError, match=r"sections\.lm\.pp: 4 pipeline stages need at least 4"):
        _section((0, 4), lambda: Decoder(32, 16, 3, 2, 16))


def test_per_sample_forward_is_refused():
    """A forward that runs the module once per sample cannot be cut: both stages say so."""

    def per_sample(module, samples, inputs):
        return [{"loss": module(s["tokens"][None]).sum()} for s in samples]

    samples = [{"id": i, "tokens": t} for i, t in enumerate(_tokens())]
    st0, sec0 = _section((0, 2), lambda: Decoder(32, 16, 2, 2, 16), per_sample)
    st0.install_hooks()
    with pytest.raises(ValueError, match="once on the whole micro-batch"):
        sec0.run(samples, {})
    st1, sec1 = _section((1, 2), lambda: Decoder(32, 16, 2, 2, 16), per_sample)
    st1.install_hooks()
    st1.incoming = torch.zeros(1, 7, 16)
    with pytest.raises(ValueError, match="more than once per micro-batch"):
        sec1.run(samples, {})


@pytest.mark.parametrize(
    "extra, match",
    [
        ("pp = 2\nzero = 1\ndp = 2", r"sections\.student\.pp: pipeline stages with zero"),
        ("pp = 0", r"sections\.student\.pp must be an integer >= 1"),
    ],
)
def test_config_refusals(extra, match):
    text = f"""
global_batch = 4
[workload]
name = "kd"
[sections.teacher]
frozen = true
[sections.student]
{extra}
"""
    with pytest.raises(ValueError, match=match):
        C.loads(text)


def test_world_size_counts_stages():
    cfg = C.loads(
        """
global_batch = 4
[workload]
name = "kd"
[sections.teacher]
frozen = true
pp = 2
[sections.student]
fsdp = 2
pp = 2
"""
    )
    assert cfg.world_size == 2 + 4
    with pytest.raises(ValueError, match=r"x pp 2 x tp 1"):
        cfg.check_world_size(5)
