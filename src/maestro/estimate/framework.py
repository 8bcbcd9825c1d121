"""Training frameworks as the cost model sees them: how they run the non-GEMM work, keep the
optimizer state, reduce gradients and overlap collectives.

``kernel_efficiency`` is the one fitted constant: the share of the measured GEMM and flash
attention ceilings (``hardware.Hardware.mamf``, ``kernels.ATTN_EFF``) a real training step's
kernels reach (real shapes, launch gaps, clocks under sustained load). It is fitted on one
published run and checked against the others (``tests/maestro/test_estimate_calibration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from maestro.estimate.kernels import Kernels


@dataclass(frozen=True)
class Framework:
    """One training framework's behaviour.

    Args:
        name: preset name (``--framework``).
        kernels: fused or eager elementwise work and the loss's bytes.
        kernel_efficiency: fitted share of the kernel ceilings (see the module docstring).
        optimizer: ``fsdp``: FSDP2 mixed precision (fp32 sharded parameters, gradients and
            Adam moments, 16 bytes per parameter over the shard group, bf16 compute copies
            gathered per block); ``distopt``: Megatron-LM's distributed optimizer (bf16
            parameters and fp32 gradients per replica, fp32 master weights and moments, 12
            bytes per parameter, sharded over data parallel).
        reduce_bytes: bytes per gradient element in the reduce-scatter / all-reduce.
        tp_overlap: tensor-parallel collectives overlap GEMMs (Megatron's
            ``--tp-comm-overlap``); ``False``: they are exposed.
        allocator_headroom: reserved over allocated memory (the caching allocator's rounding
            and fragmentation); frameworks report reserved memory.
    """

    name: str
    kernels: Kernels
    kernel_efficiency: float
    optimizer: str = "fsdp"
    reduce_bytes: float = 4.0
    tp_overlap: bool = False
    allocator_headroom: float = 0.10


# Loss bytes per logit element. Eager (torchtitan: ``cross_entropy(pred.float(), labels)``):
# bf16 logits written (2), the fp32 copy read and written (2 + 4), log-softmax read and
# written (4 + 4), its backward reading the saved output and writing the gradient (4 + 4 +
# 4), the cast back to bf16 (4 + 2): 38. Alive at the loss: bf16 logits, fp32 copy and the
# saved log-softmax (2 + 4 + 4 = 10). Fused (Megatron's vocab-parallel cross entropy, one
# fp32 pass forward and one backward): 2 + 4 + 4 + 2 = 12 moved, 2 + 4 = 6 alive.
EAGER = Kernels(fused=False, ce_bytes=38.0, logit_bytes=10.0)
FUSED = Kernels(fused=True, ce_bytes=12.0, logit_bytes=6.0)

#: fitted on torchtitan docs/performance.md Table 1, "FSDP" row (Llama 3.1 8B, 8 H100 96 GB
#: 500 W, local batch 2, sequence 8192, selective AC: 5,762 tokens/s per GPU) by
#: ``bench/maestro_estimate.py --fit``; every other published run is a test of it.
KERNEL_EFFICIENCY = 0.7731

#: allocator_headroom 0.10: assumed (PyTorch's caching allocator rounds large blocks up to
#: 2 MiB and keeps freed segments; BENCHMARKS.md shows the memory estimates without it).
FRAMEWORKS: dict[str, Framework] = {}


def _register(fw: Framework) -> Framework:
    FRAMEWORKS[fw.name] = fw
    return fw


#: PyTorch eager with FSDP2 and DTensor TP: what torchtitan runs without ``torch.compile``, and
#: what ``maestro train`` runs (Maestro's own plans are priced with it)
_register(Framework("torchtitan", EAGER, KERNEL_EFFICIENCY))
#: the same with ``torch.compile`` fusing the elementwise work and the loss
_register(Framework("torchtitan-compile", FUSED, KERNEL_EFFICIENCY))
#: Megatron-LM with Transformer Engine: fused kernels, the distributed optimizer, TP
#: communication overlapped (the flags of its published H100 scaling runs)
_register(
    # (Megatron-core's DistributedDataParallelConfig.grad_reduce_in_fp32 defaults to False:
    # gradients are reduced in bf16, 2 bytes)
    Framework(
        "megatron",
        FUSED,
        KERNEL_EFFICIENCY,
        optimizer="distopt",
        reduce_bytes=2.0,
        tp_overlap=True,
    )
)


def framework(name: str | Framework) -> Framework:
    """The preset called ``name``; ``ValueError`` lists the known ones."""
    if isinstance(name, Framework):
        return name
    if name not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {name!r}; choose one of: {', '.join(sorted(FRAMEWORKS))}"
        )
    return FRAMEWORKS[name]
