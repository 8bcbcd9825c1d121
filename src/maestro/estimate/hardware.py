"""Accelerators the cost model prices: peak figures from data sheets, achievable fractions from
published measurements. Every constant names its source; where no published figure exists the
comment says "assumed" and BENCHMARKS.md shows how far the estimates move with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links.

    Args:
        name: preset name (``--hardware``).
        flops: dense bf16 tensor-core FLOP/s (data sheet, no sparsity).
        mamf: Maximum Achievable Matmul FLOPS as a fraction of ``flops``: the best bf16 GEMM
            any shape reaches (a measured ceiling, not a fit).
        hbm_bw: HBM bandwidth, bytes/s.
        hbm_eff: fraction of ``hbm_bw`` a streaming (elementwise) kernel reaches.
        memory: HBM capacity usable by the process, bytes.
        sms: streaming multiprocessors (wave quantization of GEMM tiles).
        nvlink_bw: NVLink bandwidth per GPU and direction, bytes/s.
        nvlink_eff: NCCL bus bandwidth of a ring collective inside a node over ``nvlink_bw``.
        net_bw: inter-node bandwidth per GPU (one NIC per GPU), bytes/s.
        net_eff: NCCL bus bandwidth across nodes over ``net_bw``.
        gpus_per_node: GPUs in one NVLink domain.
        link_latency: seconds per collective step (ring hop).
        comm_sms: SMs an NCCL collective occupies while it overlaps compute (one CUDA block
            per channel): overlapped compute runs on ``sms - comm_sms``.
        kernel_launch: seconds of launch gap per kernel that a busy stream does not hide.
    """

    name: str
    flops: float
    mamf: float
    hbm_bw: float
    memory: float
    nvlink_bw: float
    net_bw: float
    hbm_eff: float = 0.85
    sms: int = 132
    nvlink_eff: float = 0.80
    net_eff: float = 0.90
    gpus_per_node: int = 8
    link_latency: float = 8e-6
    comm_sms: int = 16
    kernel_launch: float = 4e-6

    @property
    def gemm_peak(self) -> float:
        """FLOP/s of the best-shaped bf16 GEMM."""
        return self.flops * self.mamf

    @property
    def overlap_slowdown(self) -> float:
        """Factor on compute that runs while a collective is in flight (its SMs are taken)."""
        return self.sms / (self.sms - self.comm_sms)


GiB = 1024**3

# Sources (one per constant):
# - flops: NVIDIA H100 Tensor Core GPU data sheet: H100 SXM 989 TFLOP/s dense bf16 (1,979 with
#   sparsity), H100 NVL 835 (1,671 sparse); H200 SXM data sheet 989; A100 data sheet 312.
# - mamf: S. Bekman, ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul
#   FLOPS comparison table" (bf16, mean of 100 iterations): H100 SXM 794.5 / 989 = 80.3%,
#   GH200 (H200-class HBM3e) 828.6 / 989 = 83.6%, A100 SXM 271.2 / 312 = 86.9%.
# - hbm_bw / memory: data sheets: H100 SXM HBM3 3.35 TB/s, 80 GB; H200 HBM3e 4.8 TB/s, 141 GB;
#   A100 SXM4 HBM2e 2.039 TB/s, 80 GB. The torchtitan part ("h100-96g-500w"): torchtitan
#   docs/performance.md (Grand Teton): "96GB HBM2e with 2.4 TB/sec", 500 W power limit, 95 GiB
#   visible ("H100 GPUs with 95 GiB memory" in the same file's earlier revision).
# - the 500 W part's peak: torchtitan docs/performance.md footnote 2: "the actual peak TFLOPs
#   number is between SXM and NVL"; we take the geometric mean of 989 and 835 (909 TFLOP/s),
#   so either end is within 9%.
# - nvlink_bw: NVLink 4 (H100/H200) 900 GB/s per GPU in total, 450 per direction; NVLink 3
#   (A100) 600 / 300. net_bw: one 400 Gb/s NIC per GPU (DGX H100/H200, Grand Teton "400 Gb/s
#   per GPU"), one 200 Gb/s HDR NIC per GPU (DGX A100).
# - sms: H100 SXM 132 SMs, H100 NVL 132, A100 108 (NVIDIA architecture white papers).
# - hbm_eff 0.85, nvlink_eff 0.80, net_eff 0.90, comm_sms 16, kernel_launch 4 us: assumed
#   (typical streaming-kernel share of HBM peak, NCCL ring bus bandwidth over the link rate,
#   NCCL's default of one block per channel with 16 channels on NVLink); BENCHMARKS.md shows
#   the estimates' sensitivity to each.
HARDWARE: dict[str, Hardware] = {
    "h100-sxm": Hardware("h100-sxm", 989e12, 0.803, 3.35e12, 80e9, 450e9, 50e9),
    "h100-96g-500w": Hardware("h100-96g-500w", 909e12, 0.803, 2.4e12, 95 * GiB, 450e9, 50e9),
    "h200": Hardware("h200", 989e12, 0.836, 4.8e12, 141e9, 450e9, 50e9),
    "a100-80g": Hardware("a100-80g", 312e12, 0.869, 2.039e12, 80e9, 300e9, 25e9, sms=108),
}

#: old preset names (``maestro.costmodel.GPU_PRESETS``) -> hardware presets
ALIASES = {"h100": "h100-sxm", "a100": "a100-80g"}


def hardware(name: str | Hardware) -> Hardware:
    """The preset called ``name`` (case-insensitive); ``ValueError`` lists the known ones."""
    if isinstance(name, Hardware):
        return name
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]
