"""Accelerator presets for ``tandem plan``: memory, memory bandwidth and dense
tensor-core throughput per dtype, as the vendors' datasheets give them (dense figures:
the "with sparsity" numbers are twice these and do not apply to LLM inference).

Where a chip has no units for a dtype (FP8 on A100 and T4, BF16 on T4), the preset
gives the rate it would actually run at: weights are widened to the next type it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError

# A small all-reduce between GPUs of one host, as NCCL's tests report it: tens of
# microseconds (an assumption where a datasheet gives none: `--link-latency-us`).
DEFAULT_LINK_LATENCY_US = 20.0
PCIE4_X16_GBS = 32.0  # each way


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float  # per device, decimal GB
    bandwidth_gbs: float  # memory bandwidth, GB/s
    tflops: dict[str, float] = field(default_factory=dict)  # dtype -> dense TFLOP/s
    source: str = ""
    # The rate a prompt's attention runs at, where measured (this_machine): on a CPU
    # far below the matmuls' (float32 beside integer dots) and lower for short prompts.
    attention_tflops: float | None = None
    # The rate a decode step's attention reads K/V, where measured (this_machine): the
    # kernel's, below the machine's read bandwidth.
    kv_bandwidth_gbs: float | None = None
    # Between two devices of a tensor-parallel group: GB/s each way (the datasheet's
    # NVLink or PCIe figure, halved: those count both directions) and one small
    # all-reduce's latency.
    link_gbs: float | None = None
    link_latency_us: float = DEFAULT_LINK_LATENCY_US
    # The engine's fixed cost of a decode step, by batch, where measured (this_machine
    # on a GGUF file: plan/fixed_cost.py): the host's work and every layer's calls
    # beyond the weights' and KV's reads. None measured: 0, a floor.
    step_overheads: dict[int, float] = field(default_factory=dict)

    def link(self) -> tuple[float, float]:
        """(GB/s, seconds) of the link a collective crosses; no figure: PCIe 4.0 x16's."""
        return self.link_gbs or PCIE4_X16_GBS, self.link_latency_us * 1e-6

    def flops_for(self, dtype: str) -> float:
        if dtype in self.tflops:
            return self.tflops[dtype]
        return self.tflops.get("bf16") or next(iter(self.tflops.values()))

    def step_overhead(self, batch: float) -> float:
        """Seconds a step of ``batch`` sequences spends beyond its reads and FLOPs: the
        measured batch's; between two measured batches, or beyond the largest (the
        twin runs at most fixed_cost.MAX_BATCH), the straight line through the nearest
        two; below the smallest, the smallest's; 0 where nothing was measured."""
        if not self.step_overheads:
            return 0.0
        points = sorted(self.step_overheads.items())
        if len(points) == 1 or batch <= points[0][0]:
            return points[0][1]
        above = next((i for i, (b, _) in enumerate(points) if b >= batch), len(points) - 1)
        (b0, s0), (b1, s1) = points[above - 1], points[above]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    def attention_rate(self, dtype: str) -> float:
        """TFLOP/s of attention computed in ``dtype``: measured, else the matmul rate."""
        return self.attention_tflops or self.flops_for(dtype)


PRESETS = {
    "a100-80g": Hardware(
        "NVIDIA A100 80GB SXM", 80, 2039,
        {"fp32": 19.5, "bf16": 312, "fp16": 312, "fp8": 312, "int8": 624},
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB column; FP32 without TF32; "
        "NVLink 600 GB/s)",
        link_gbs=300,
    ),
    "h100-sxm": Hardware(
        "NVIDIA H100 SXM", 80, 3350,
        {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979},
        "NVIDIA H100 Tensor Core GPU datasheet (SXM column; NVLink 900 GB/s)",
        link_gbs=450,
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", 141, 4800,
        {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979},
        "NVIDIA H200 Tensor Core GPU datasheet (SXM column; NVLink 900 GB/s)",
        link_gbs=450,
    ),
    "l4": Hardware(
        "NVIDIA L4", 24, 300,
        {"fp32": 30.3, "bf16": 121, "fp16": 121, "fp8": 242.5, "int8": 242.5},
        "NVIDIA L4 Tensor Core GPU datasheet (PCIe Gen4 x16, 64 GB/s)",
        link_gbs=32,
    ),
    "t4": Hardware(
        "NVIDIA T4", 16, 320,
        {"fp32": 8.1, "bf16": 65, "fp16": 65, "fp8": 65, "int8": 130},
        "NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed precision; no BF16 or FP8 units; "
        "PCIe Gen3 x16, 32 GB/s)",
        link_gbs=16,
    ),
    # A CPU socket as a device: two of them are a 2-socket server, its sockets
    # tensor-parallel ranks (each its own memory) meeting in shared memory.
    "epyc-9654": Hardware(
        "AMD EPYC 9654 socket", 384, 460.8,
        {"fp32": 7.4, "bf16": 14.7, "int8": 29.5},
        "AMD EPYC 9654 datasheet: 96 cores at 2.4 GHz, 12 channels of DDR5-4800 "
        "(460.8 GB/s); peak from Zen 4's two 256-bit FMA pipes (bf16 dot products x2, "
        "int8 x4); 12 x 32 GB DIMMs; 4 xGMI links to the other socket; the all-reduce "
        "latency is tandem's shared-memory figure",
        link_gbs=256, link_latency_us=25,
    ),
}  # fmt: skip


def custom_hardware(memory_gb: float | None, bandwidth_gbs: float | None, tflops: float | None):
    missing = [
        flag
        for flag, value in (("--memory", memory_gb), ("--bandwidth", bandwidth_gbs),
                            ("--flops", tflops))
        if value is None
    ]  # fmt: skip
    if missing:
        raise InvalidParameterError("hardware", f"custom hardware needs {', '.join(missing)}")
    return Hardware("custom", memory_gb, bandwidth_gbs, {"any": tflops}, "the command line")
