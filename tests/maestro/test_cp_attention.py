"""Ring attention (``maestro.parallel.cp``) alone: two gloo ranks, each holding the head and
tail chunk of every sequence, equal plain SDPA over whole sequences (outputs and q/k/v
gradients, float64, causal and not, even and uneven lengths); and the share arithmetic."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from maestro.parallel import cp as C


def test_chunk_bounds_balance_and_cover():
    assert C.chunk_bounds(8, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert C.chunk_bounds(10, 2) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert C.rank_chunks(0, 2) == (0, 3) and C.rank_chunks(1, 2) == (1, 2)


def test_split_cuts_tokens_with_overlap_and_predictions_without():
    s = {"tokens": torch.arange(10), "id": 3}
    ins = {"teacher": [{"logits": torch.arange(9.0)[:, None]}]}
    vs, vin, rows = C.split_micro_batch([s], ins, 2, 0, "sections.x")
    # rank 0 holds chunks 0 ([0, 3)) and 3 ([8, 10)): tokens with the next chunk's first
    assert vs[0]["tokens"].tolist() == [0, 1, 2, 3] and vs[1]["tokens"].tolist() == [8, 9]
    assert vin["teacher"][0]["logits"].flatten().tolist() == [0, 1, 2]
    assert vin["teacher"][1]["logits"].flatten().tolist() == [8]
    assert rows == [[(0, 3), (8, 2)], [(3, 3), (6, 2)]]
    with pytest.raises(ValueError, match=r"sections.x.cp = 2: a sample has 3 tokens"):
        C.split_micro_batch([{"tokens": torch.arange(3)}], {}, 2, 0, "sections.x")


def _local(full, rows, length):
    """This rank's right-padded (rows, H, L, D) tensor from per-sample (H, T, D) tensors."""
    out = torch.zeros(len(rows), full[0].shape[0], length, full[0].shape[2], dtype=full[0].dtype)
    for j, (start, _) in enumerate(rows):
        x = full[j // 2]
        n = min(length, x.shape[1] - start)
        out[j, :, :n] = x[:, start : start + n]
    return out


def _check(rank, causal, lengths, cp):
    h, d = 2, 4
    g = torch.Generator().manual_seed(7)
    q, k, v, w = (
        [torch.randn(h, t, d, generator=g, dtype=torch.float64) for t in lengths] for _ in range(4)
    )
    samples = [{"tokens": torch.arange(t)} for t in lengths]
    vs, _, rows = C.split_micro_batch(samples, {}, cp, rank, "sections.x")
    # the chunk samples' lengths, as a forward right-pads them (overlap token included)
    length = max(x["tokens"].numel() for x in vs)
    ql, kl, vl = (_local(x, rows[rank], length).requires_grad_() for x in (q, k, v))
    ctx = C.CPContext(
        group=dist.group.WORLD, cp=cp, index=rank, rows=rows, where="sections.x", ranks=[*range(cp)]
    )
    with C.active(ctx):
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
    assert ctx.calls == 1
    # loss over this rank's real positions only (the overlap token is a query only)
    wl = _local(w, rows[rank], length)
    keep = torch.zeros(len(rows[rank]), 1, length, 1, dtype=torch.float64)
    for j, (_, n) in enumerate(rows[rank]):
        keep[j, :, :n] = 1
    (out * wl * keep).sum().backward()
    grads = []
    for full, loc in ((q, ql), (k, kl), (v, vl)):
        acc = [torch.zeros_like(x) for x in full]
        for j, (start, _) in enumerate(rows[rank]):
            m = min(length, full[j // 2].shape[1] - start)
            acc[j // 2][:, start : start + m] += loc.grad[j, :, :m]
        flat = torch.cat([a.flatten() for a in acc])
        dist.all_reduce(flat)
        grads.append(flat)
    for i in range(len(lengths)):
        qi, ki, vi = (x[i].clone().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=causal)[0]
        for j, (start, n) in enumerate(rows[rank]):
            if j // 2 == i:
                torch.testing.assert_close(
                    out[j, :, :n], ref[:, start : start + n], rtol=1e-12, atol=1e-12
                )
    ref_grads = [[], [], []]
    for i in range(len(lengths)):
        qi, ki, vi = (x[i].clone().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=causal)[0]
        (ref * w[i]).sum().backward()
        for a, x in zip(ref_grads, (qi, ki, vi)):
            a.append(x.grad.flatten())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, torch.cat(want), rtol=1e-10, atol=1e-12)


def _worker(rank, world, tile, port, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    C.TILE = tile  # small tiles: a block's queries in several pieces
    try:
        for causal in (True, False):
            for lengths in ((8, 12), (9, 4, 13)) if world == 2 else ((17, 8), (11,)):
                _check(rank, causal, lengths, world)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("world, tile", [(2, 1024), (4, 5)])
def test_ring_attention_equals_sdpa_on_gloo_ranks(world, tile):
    """cp = 2 (one hop each way) and cp = 4 (a ring of 4, query tiles of 5 rows)."""
    from maestro.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _worker, args=(world, tile, free_port(), errors), nprocs=world, start_method="spawn"
        )
    except mp.ProcessRaisedException:
        pass
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, msgs[0]


# -- refusals: one line naming the section and the reason ------------------------------------


class _NoSDPA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)

    def forward(self, tokens):
        return self.emb(tokens)


class _Masked(_NoSDPA):
    def forward(self, tokens):
        x = self.emb(tokens)[:, None]  # (B, 1, T, D)
        mask = torch.ones(x.shape[2], x.shape[2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)[:, 0]


def _fwd(module, samples, inputs):
    from maestro.workloads.layers import pad_stack

    out = module(pad_stack([s["tokens"] for s in samples]))
    return [{"loss": out[i, : s["tokens"].numel()].sum()} for i, s in enumerate(samples)]


def _per_sample(module, samples, inputs):
    return [{"loss": module(s["tokens"][None]).sum()} for s in samples]


@pytest.mark.parametrize(
    "module, forward, length, match",
    [
        (_NoSDPA, _fwd, 8, r"^sections\.lm\.cp: no torch\.nn\.functional\.scaled_dot_product"),
        (_Masked, _fwd, 8, r"^sections\.lm\.cp: cannot split .*passes an attn_mask"),
        (_Masked, _per_sample, 8, r"^sections\.lm\.cp: cannot split .*attn_mask"),
        (_NoSDPA, _fwd, 3, r"^sections\.lm\.cp = 2: a sample has 3 tokens, fewer than 2 x cp"),
    ],
)
def test_cp_refuses_in_one_line(module, forward, length, match):
    run = C.cp_forward(forward, 2, 0, None, "sections.lm")
    with pytest.raises(ValueError, match=match) as e:
        run(module(), [{"tokens": torch.arange(length) % 8}], {})
    assert "\n" not in str(e.value)


def test_cp_refuses_a_forward_that_runs_samples_one_by_one():
    class Attn(_NoSDPA):
        def forward(self, tokens):
            x = self.emb(tokens)[:, None]
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)[:, 0]

    run = C.cp_forward(_per_sample, 2, 0, None, "sections.lm")
    with pytest.raises(ValueError, match=r"runs 1 rows, but the micro-batch has 2 chunk"):
        run(Attn(), [{"tokens": torch.arange(8)}], {})


# -- config and layout -------------------------------------------------------------------------

_TOML = """
global_batch = 4
[workload]
name = "kd"
[sections.teacher]
frozen = true
{teacher}
[sections.student]
{student}
"""


def test_config_cp_counts_ranks_and_refuses_what_it_cannot_compose():
    from maestro import config as cfgmod

    cfg = cfgmod.loads(_TOML.format(teacher="cp = 2\ntp = 2", student="fsdp = 2\ncp = 2"))
    assert cfg.sections["teacher"].cp == 2 and cfg.world_size == 8
    with pytest.raises(ValueError, match=r"x cp 2 x tp 2.*world size is 4"):
        cfg.check_world_size(4)
    for bad, match in (
        ("cp = 0", r"sections\.student\.cp must be an integer >= 1, got 0"),
        (
            'cp = 2\ngroup = "g"',
            r"sections\.student\.cp: context parallelism does not compose with group",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            cfgmod.loads(_TOML.format(teacher="", student=bad))


def test_layout_orders_ranks_dp_fsdp_cp_tp():
    from maestro.parallel.mesh import SectionLayout

    lay = SectionLayout("s", tuple(range(16)), dp=2, fsdp=2, tp=2, cp=2)
    assert lay.grid()[1][0] == [[8, 9], [10, 11]]  # [dp][fsdp][cp][tp]
    assert lay.dims == ("dp", "fsdp", "cp", "tp")
    assert lay.replica_of(11) == 2 and lay.cp_index(11) == 1 and lay.coordinate(11) == (1, 0, 1)
    assert lay.cp_peers(9) == [9, 11] and lay.tp_peers(10) == [10, 11]
    assert lay.replica_ranks(1) == [4, 5, 6, 7] and lay.leader(1) == 4
    assert lay.output_ranks(1) == [4, 5, 6, 7] and lay.dp_peers(5) == [1, 5, 9, 13]
    assert lay.cp_groups()[:2] == [[0, 2], [1, 3]]


def test_share_gives_each_rank_its_rows_and_unshare_returns_them():
    """A producer sends CP rank ``r`` only the rows of its chunk samples; cut on arrival,
    they equal the cut of the whole tensor; the ranks' gradients add up to the whole one."""
    length, cp = 11, 2
    whole = {"h": torch.arange(11.0)[:, None], "logits": torch.arange(10.0)[:, None], "n": 3}
    sample = {"tokens": torch.arange(length)}
    total = {k: torch.zeros_like(whole[k]) for k in ("h", "logits")}
    for r in range(cp):
        part = C.share(whole, length, cp, r)
        assert part["n"] == 3 and part["h"].shape[0] < length
        a = C.split_micro_batch([sample], {"p": [part]}, cp, r, "s", shared=True)[1]["p"]
        b = C.split_micro_batch([sample], {"p": [whole]}, cp, r, "s")[1]["p"]
        for x, y in zip(a, b):
            assert all(torch.equal(x[k], y[k]) for k in ("h", "logits"))
        for k in total:
            total[k] += C.unshare(torch.ones_like(part[k]), whole[k], length, cp, r)
    # chunks [0, 3) [3, 6) [6, 9) [9, 11): every position once, the first token of each
    # chunk but the first twice (it is also the previous chunk sample's overlap token, a
    # query only, whose gradient is zero in a real run); predictions have no overlap
    assert total["logits"].flatten().tolist() == [1.0] * 10
    assert total["h"].flatten().tolist() == [1, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1]


def test_mllm_split_cuts_the_interleaved_sequence_through_an_image():
    from maestro.workloads import mllm

    sample = {"tokens": torch.arange(10, 16), "image_pos": 2, "image": torch.zeros(3, 2)}
    inputs = {"vision": {"embeds": torch.arange(3.0)[:, None]}}
    assert mllm._fused_length(sample, inputs) == 9  # text 10 11 | image 0 1 2 | text 12 .. 15
    # positions 0 .. 3 (chunk [0, 3) and its overlap): two text tokens, two image rows
    cs, cin = mllm._fused_cut(sample, inputs, 0, 4)
    assert cs["tokens"].tolist() == [10, 11] and cs["image_pos"] == 2
    assert cin["vision"]["embeds"].flatten().tolist() == [0.0, 1.0]
    # positions 4 .. 6: the image's last row first, then text
    cs, cin = mllm._fused_cut(sample, inputs, 4, 7)
    assert cs["tokens"].tolist() == [12, 13] and cs["image_pos"] == 0
    assert cin["vision"]["embeds"].flatten().tolist() == [2.0]
    cs, cin = mllm._fused_cut(sample, {"vision": None}, 1, 3)  # a text-only sample
    assert cs["tokens"].tolist() == [11, 12] and cin == {"vision": None}


def test_assemble_own_rows_and_unshare_rows_invert_each_other():
    """A CP producer's pieces (per position and per prediction) assemble into the whole
    tensor; each rank's ``own_rows`` of it is its piece; a consumer share's gradient is read
    back to the whole shape without knowing it."""
    length, cp = 13, 3
    for full in (length, length - 1):
        whole = torch.arange(float(full))[:, None]
        pieces = [C.own_rows(whole, length, cp, r) for r in range(cp)]
        assert torch.equal(C.assemble(pieces, length, cp), whole)
        for j in range(cp):
            part = C.share({"x": whole}, length, cp, j)["x"]
            back = C.unshare_rows(part, length, cp, j)
            assert back.shape == whole.shape
            assert torch.equal(back, C.unshare(part, whole, length, cp, j))
