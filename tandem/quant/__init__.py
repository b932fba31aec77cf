"""Quantized weights: llama.cpp's block formats, read, written and multiplied.

blocks.py     GGML block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
              FORMATS, one row each (sizes, packed and split layouts, bytes a
              weight), and raw bytes -> integer values + scales (the one decoder)
quantize.py   float weights -> Q8_0 / Q4_0 / Q4_K bytes (quantize on load, export)
split_blocks.py  the GPU's layouts (BlockWeight, SuperBlockWeight) for the Triton kernels
packed.py     PackedWeight: a matrix in the layout the integer-dot kernel reads,
              and the exact-math reference product the tests compare it with
"""
