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


def _check(rank, causal, lengths):
    cp, h, d = 2, 2, 4
    g = torch.Generator().manual_seed(7)
    q, k, v, w = (
        [torch.randn(h, t, d, generator=g, dtype=torch.float64) for t in lengths] for _ in range(4)
    )
    samples = [{"tokens": torch.arange(t)} for t in lengths]
    vs, _, rows = C.split_micro_batch(samples, {}, cp, rank, "sections.x")
    # the chunk samples' lengths, as a forward right-pads them (overlap token included)
    length = max(x["tokens"].numel() for x in vs)
    ql, kl, vl = (_local(x, rows[rank], length).requires_grad_() for x in (q, k, v))
    ctx = C.CPContext(group=dist.group.WORLD, cp=cp, index=rank, rows=rows, where="sections.x")
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


def _worker(rank, port, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for causal in (True, False):
            for lengths in ((8, 12), (9, 4, 13)):
                _check(rank, causal, lengths)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_ring_attention_equals_sdpa_on_two_gloo_ranks():
    from maestro.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(free_port(), errors), nprocs=2, start_method="spawn")
    except mp.ProcessRaisedException:
        pass
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, msgs[0]
