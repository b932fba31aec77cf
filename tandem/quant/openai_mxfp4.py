"""MXFP4 as OpenAI's checkpoints hold it (gpt-oss's Hugging Face files) -> GGML's blocks.

Both hold blocks of 32 FP4 (E2M1) values under one E8M0 exponent; they order the
block's nibbles differently:

    OpenAI   ``<name>_blocks`` [..., blocks, 16] bytes: byte j holds value 2j in its
             low nibble, value 2j + 1 in its high one; ``<name>_scales`` [..., blocks]
             the exponents, w = 2**(e - 127) * E2M1[q]
    GGML     one 17-byte block: the exponent, then byte j holds value j low and value
             j + 16 high; w = 2**(e - 128) * (2 * E2M1)[q] (quant/blocks.py's MXFP4)

The values and exponents are the same numbers, so the conversion moves nibbles and
decodes nothing: the file's bits are what the kernels multiply.
"""

from __future__ import annotations

import torch


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [rows, n, 16] and scales uint8 [rows, n] (OpenAI's) -> uint8
    [rows, n * 17], the rows as GGML's MXFP4 blocks."""
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [rows, n, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).flatten(-2).contiguous()
