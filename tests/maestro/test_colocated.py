"""Colocated groups without processes: config validation, the unit graph, member chunks."""

import pytest
import torch

from maestro import config as C
from maestro.runtime.colocated import chunks, split_even, unit_graph
from maestro.workloads import get_workload

MLLM = """
global_batch = 6
[workload]
name = "mllm"
vocab_size = 32
seq_len_min = 4
seq_len_max = 10
llm_dim = 8
llm_layers = 1
heads = 2
vision_dim = 8
vision_layers = 1
image_patches = 2
patch_dim = 4
audio_dim = 8
audio_layers = 1
audio_frames = 2
frame_dim = 3
mix = {{ text = 0.4, image = 0.3, "image+audio" = 0.3 }}
[sections.vision]
dp = {vdp}
micro_batch_size = 3
{vextra}
[sections.audio]
dp = 1
micro_batch_size = 2
{aextra}
[sections.llm]
dp = 2
micro_batch_size = 2
{lextra}
"""


def cfg(vdp=2, vextra="", aextra="", lextra="", ldp=2):
    text = MLLM.format(vdp=vdp, vextra=vextra, aextra=aextra, lextra=lextra)
    return C.loads(text.replace("[sections.llm]\ndp = 2", f"[sections.llm]\ndp = {ldp}"))


def test_a_group_counts_its_ranks_once_and_is_one_unit():
    c = cfg(vextra='group = "g"', lextra='group = "g"')
    assert c.world_size == 3 and c.colocated
    # producers first: the group reads audio
    assert list(c.units().items()) == [("audio", ["audio"]), ("vision+llm", ["vision", "llm"])]
    assert c.rank_layout()["vision"] == c.rank_layout()["llm"]
    specs = {s.name: s for s in c.unit_specs()}
    # a mixed layout: the group micro-batch is the smallest member size (plan.colocate's rule)
    assert specs["vision+llm"].micro_batch_size == 2 and specs["vision+llm"].inputs == ("audio",)
    assert specs["vision+llm"].dp == 2 and not specs["vision+llm"].frozen
    c.check_world_size(3)
    with pytest.raises(ValueError, match="colocated group counted once"):
        c.check_world_size(5)


def test_the_whole_model_in_one_group_takes_the_largest_member_micro_batch():
    g = 'group = "all"'
    c = C.loads(
        MLLM.format(vdp=2, vextra=g, aextra=g, lextra=g).replace(
            "[sections.audio]\ndp = 1", "[sections.audio]\ndp = 2"
        )
    )
    (spec,) = c.unit_specs()
    assert spec.name == "vision+audio+llm" and spec.micro_batch_size == 3 and spec.inputs == ()
    assert c.world_size == 2


def test_members_share_the_group_ranks_each_on_its_own_grid():
    with pytest.raises(ValueError, match=r"sections\.llm: members of group 'g' share its ranks"):
        cfg(vdp=1, vextra='group = "g"', lextra='group = "g"')
    # FSDP ranks are data parallel: vision at fsdp = 2 fills the llm's dp = 2
    assert cfg(vdp=1, vextra='group = "g"\nfsdp = 2', lextra='group = "g"').world_size == 3
    # vision at dp = 2 beside the LLM at tp = 2: one group replica of two ranks
    c = cfg(vextra='group = "g"', lextra='group = "g"\ntp = 2', ldp=1)
    assert c.group_tp("vision+llm") == 2
    specs = {s.name: s for s in c.unit_specs()}
    assert specs["vision+llm"].tp == 2 and specs["vision+llm"].dp == 1
    assert c.world_size == 3
    with pytest.raises(ValueError, match=r"sections\.llm\.tp: inside group 'g' every"):
        cfg(vdp=2, vextra='group = "g"\ntp = 3', lextra='group = "g"\ntp = 2', ldp=3)


def test_split_even_gives_every_sub_replica_a_contiguous_part():
    assert split_even([4, 5, 6, 7, 8], 2) == [[4, 5, 6], [7, 8]]
    assert split_even([1], 3) == [[1], [], []]
    assert split_even([], 2) == [[], []]


def test_a_section_on_a_path_between_members_is_an_error():
    # vision -> audio -> llm: grouping vision with llm would need audio inside the group
    with pytest.raises(ValueError, match="lies on a path between two of its members"):
        cfg(vextra='group = "g"', aextra='inputs = ["vision"]', lextra='group = "g"')


def test_a_group_with_a_sink_cannot_feed_outside():
    # audio reads vision and is a sink of its own; vision + llm grouped hold the sink llm
    with pytest.raises(ValueError, match="holds the sink 'llm' and also feeds"):
        cfg(
            vextra='group = "g"',
            aextra='inputs = ["vision"]',
            lextra='group = "g"\ninputs = ["vision"]',
        )


def test_member_chunks_follow_micro_batch_size_and_token_budget():
    assert chunks([0, 1, 2, 3, 4], 2, None, [1] * 5) == [[0, 1], [2, 3], [4]]
    # 3 samples fit one chunk of 4, but 30 tokens over a budget of 12 need 3 chunks
    assert chunks([5, 6, 7], 4, 12, [10, 10, 10]) == [[5], [6], [7]]
    assert chunks([], 2, None, []) == []


def test_the_unit_graph_runs_the_group_like_the_members():
    """A group's forward equals its members run one after another (and carries the loss)."""
    c = cfg(vextra='group = "g"', lextra='group = "g"')
    wl = get_workload(c)
    real = wl.graph()
    g = unit_graph(c, real, lambda s: float(wl.sample_cost(s)["tokens"]))
    assert g.names == ["audio", "vision+llm"] and g.is_sink("vision+llm")
    batch = wl.batch(0)
    aud = real["audio"]
    a_in = [s for s in batch if aud.activated(s)]
    a_out = dict(zip([s["id"] for s in a_in], aud.run(a_in, {})))
    grp = g["vision+llm"]
    outs = grp.run(batch, {"audio": [a_out.get(s["id"]) for s in batch]})
    from maestro.runtime.local import compound_loss

    want = compound_loss(real, batch)
    got = torch.stack([o["loss"] for o in outs]).sum()
    torch.testing.assert_close(got, want)
