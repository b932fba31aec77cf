"""Accelerator presets for ``tandem plan``: memory, memory bandwidth and dense
tensor-core throughput per dtype, as the vendors' datasheets give them (dense figures:
the "with sparsity" numbers are twice these and do not apply to LLM inference).

Where a chip has no units for a dtype (FP8 on A100 and T4, BF16 on T4), the preset
gives the rate it would actually run at: weights are widened to the next type it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidParameterError


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

    def flops_for(self, dtype: str) -> float:
        if dtype in self.tflops:
            return self.tflops[dtype]
        return self.tflops.get("bf16") or next(iter(self.tflops.values()))

    def attention_rate(self, dtype: str) -> float:
        """TFLOP/s of attention computed in ``dtype``: measured, else the matmul rate."""
        return self.attention_tflops or self.flops_for(dtype)


PRESETS = {
    "a100-80g": Hardware(
        "NVIDIA A100 80GB SXM", 80, 2039,
        {"fp32": 19.5, "bf16": 312, "fp16": 312, "fp8": 312, "int8": 624},
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB column; FP32 without TF32)",
    ),
    "h100-sxm": Hardware(
        "NVIDIA H100 SXM", 80, 3350,
        {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979},
        "NVIDIA H100 Tensor Core GPU datasheet (SXM column)",
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", 141, 4800,
        {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979},
        "NVIDIA H200 Tensor Core GPU datasheet (SXM column)",
    ),
    "l4": Hardware(
        "NVIDIA L4", 24, 300,
        {"fp32": 30.3, "bf16": 121, "fp16": 121, "fp8": 242.5, "int8": 242.5},
        "NVIDIA L4 Tensor Core GPU datasheet",
    ),
    "t4": Hardware(
        "NVIDIA T4", 16, 320,
        {"fp32": 8.1, "bf16": 65, "fp16": 65, "fp8": 65, "int8": 130},
        "NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed precision; no BF16 or FP8 units)",
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
