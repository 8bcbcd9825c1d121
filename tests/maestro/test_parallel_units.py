"""maestro.parallel on its own: rank arithmetic, and the appliers on real gloo ranks (float64).

One spawn of 4 ranks checks, against the same module in one process: the Block TP plan
(packed qkv split by heads), FSDP2 x TP on a Decoder with SUMmed gradients and uneven
micro-batch counts padded with zero-loss micro-batches, the Hugging Face Llama plan,
recompute, global-norm clipping and ZeRO-1's step.
"""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from maestro.parallel.mesh import SectionLayout


def test_layout_coordinates():
    lay = SectionLayout("llm", tuple(range(4, 12)), dp=2, fsdp=2, tp=2)
    assert lay.num_replicas == 4
    assert lay.coordinate(4) == (0, 0, 0) and lay.coordinate(11) == (1, 1, 1)
    assert lay.coordinate(7) == (0, 1, 1)
    assert lay.replica_of(7) == 1 and lay.replica_ranks(1) == [6, 7]
    assert lay.leader(3) == 10 and lay.tp_peers(9) == [8, 9]
    assert lay.dp_peers(5) == [5, 7, 9, 11]
    assert lay.grid() == [[[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    with pytest.raises(ValueError, match="sections.llm: dp 2 x fsdp 2 x tp 2 = 8 ranks"):
        SectionLayout("llm", (0, 1), dp=2, fsdp=2, tp=2)


def test_tp_degree_must_divide_heads_and_width():
    from maestro.parallel.tp import _check_divisible
    from maestro.workloads.layers import Block

    _check_divisible(Block(16, 4, causal=True), 2, "sections.llm")
    with pytest.raises(ValueError, match=r"sections\.llm\.tp must divide the attention heads"):
        _check_divisible(Block(16, 2, causal=True), 4, "sections.llm")


def _max_rel(a: dict, b: dict) -> float:
    errs = {k: float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-30)) for k in b}
    worst = max(errs, key=errs.get)
    if errs[worst] > 1e-10:
        print("worst", worst, errs[worst], sorted(errs.items(), key=lambda kv: -kv[1])[:4])
    return errs[worst]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_block_tp(rank):
    from maestro.parallel.tp import apply_tp
    from maestro.workloads.layers import Block

    torch.manual_seed(0)
    ref = Block(16, 4, causal=True).double()
    blk = Block(16, 4, causal=True).double()
    blk.load_state_dict(ref.state_dict())
    mesh = dist.device_mesh.DeviceMesh(
        "cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("a", "tp")
    )
    apply_tp([blk], mesh["tp"])
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    out = blk(xt)
    out.pow(2).sum().backward()
    assert (out - ref(x)).abs().max() < 1e-12
    assert (xt.grad - xr.grad).abs().max() < 1e-12, "input grad must be all-reduced over TP"
    g = {n: _full(p.grad) for n, p in blk.named_parameters()}
    assert _max_rel(g, {n: p.grad for n, p in ref.named_parameters()}) < 1e-12
    assert blk.qkv.weight.to_local().shape == (24, 16)


def _check_fsdp_tp_decoder(rank):
    from maestro.parallel.apply import SectionRoot, apply_fsdp, apply_recompute, transformer_blocks
    from maestro.parallel.grads import clip_grads
    from maestro.parallel.tp import apply_tp
    from maestro.workloads.layers import Decoder

    torch.manual_seed(0)
    ref = Decoder(32, 16, 2, 2, 12).double()
    m = Decoder(32, 16, 2, 2, 12).double()
    m.load_state_dict(ref.state_dict())
    mesh = dist.device_mesh.DeviceMesh(
        "cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("fsdp", "tp")
    )
    blocks = transformer_blocks(m)
    apply_tp(blocks, mesh["tp"])
    apply_recompute(blocks)
    root = SectionRoot(m)
    apply_fsdp(root, blocks, mesh["fsdp"])
    toks = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(2))

    def run(mod, t, inputs=None):
        return mod.forward_embeds(mod.tok(t))  # not mod(...): the root must gather anyway

    fsdp_rank = rank // 2
    if fsdp_rank == 0:  # two micro-batches
        for mb in (toks[:1], toks[1:2]):
            root(run, mb, None).sum().backward()
    else:  # one micro-batch and one zero-loss dummy
        root(run, toks[2:], None).sum().backward()
        (root(run, toks[:1], None).sum() * 0.0).backward()
    run(ref, toks).sum().backward()
    params = list(m.parameters())
    norm = clip_grads(params, 1e9, mesh)
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1e9, foreach=False)
    assert abs(norm - float(want)) <= 1e-10 * float(want)
    got = {n: _full(p.grad) for n, p in m.named_parameters()}
    assert _max_rel(got, {n: p.grad for n, p in ref.named_parameters()}) < 1e-10


def _check_hf_llama(rank):
    from transformers import LlamaConfig, LlamaForCausalLM

    from maestro.parallel.apply import transformer_blocks
    from maestro.parallel.tp import apply_tp

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).double()
    m = LlamaForCausalLM(cfg).double()
    m.load_state_dict(ref.state_dict())
    mesh = dist.device_mesh.DeviceMesh(
        "cpu", torch.tensor([[0, 1], [2, 3]]), mesh_dim_names=("a", "tp")
    )
    blocks = transformer_blocks(m)
    assert len(blocks) == 1
    apply_tp(blocks, mesh["tp"])
    toks = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    ref(toks).logits.sum().backward()
    out = m(toks).logits
    out.sum().backward()
    assert (out - ref(toks).logits).abs().max() < 1e-10
    got = {n: _full(p.grad) for n, p in m.named_parameters()}
    assert _max_rel(got, {n: p.grad for n, p in ref.named_parameters()}) < 1e-10


def _check_zero(rank):
    from maestro.parallel.zero import ZeroOptimizer

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).double()
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).double()
    m.load_state_dict(ref.state_dict())

    def make(ps):
        return torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=False)

    opt_ref = make(list(ref.parameters()))
    opt = ZeroOptimizer(list(m.parameters()), make)
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for _ in range(3):
        for mod, o in ((ref, opt_ref), (m, opt)):
            o.zero_grad()
            mod(x).pow(2).sum().backward()
            o.step()
    assert _max_rel(m.state_dict(), ref.state_dict()) == 0.0
    n = sum(p.numel() for p in m.parameters())
    assert sum(v["exp_avg"].numel() for v in opt.state.values()) in (n // 4, n // 4 + 1)


def _worker(rank, world, port, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for check in (_check_block_tp, _check_fsdp_tp_decoder, _check_hf_llama, _check_zero):
            check(rank)
            dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_appliers_on_four_gloo_ranks():
    from maestro.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(4, free_port(), errors), nprocs=4, start_method="spawn")
    except mp.ProcessRaisedException:
        pass
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, msgs[0]
