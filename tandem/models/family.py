"""Family: everything tandem knows about one model family, in one row.

Each family's module (llama.py, qwen3.py, gemma3.py, ...) ends with its descriptor;
models/registry.py lists them. The Hugging Face loader, the GGUF reader and writer,
tensor parallelism and the fused decode path read a family's facts from here and
nowhere else, so adding a Llama-shaped family is its module and one line in the
registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # as the docs' table and the errors name it
    # config.json ``architectures`` names this family answers to.
    architectures: tuple[str, ...]
    model_class: Any  # a models.registry.CausalLM class
    # GGUF (llama.cpp's ``general.architecture``): the name it reads, or None when no
    # GGUF file of the family is read; the name its files are written as (llama.cpp's
    # converter writes Mistral and Mixtral as llama); whether that name holds experts
    # (llama with ``expert_count`` is Mixtral).
    gguf_architecture: str | None = None
    gguf_export_as: str | None = None
    gguf_has_experts: bool = False
    # How llama.cpp's converter changed the tensors: q/k rows permuted for its rotary
    # layout; norm weights written as 1 + weight.
    gguf_permuted_qk: bool = False
    gguf_norm_plus_one: bool = False
    # GGUF layer tensors (names as gguf_layer_names' keys) of norms stored as they are
    # although the family's others are written plus one (Qwen3.5's delta-net norm).
    gguf_plain_norms: tuple[str, ...] = ()
    # GGUF layer tensor names that differ from gguf_checkpoint.LAYER_NAMES (None: a
    # common name the family's files do not use).
    gguf_layer_names: dict[str, str | None] = field(default_factory=dict)
    # The same for the tensors outside the layers (gguf_checkpoint.GLOBAL_NAMES): LFM2's
    # final norm is token_embd_norm, and its files have no output_norm.
    gguf_global_names: dict[str, str | None] = field(default_factory=dict)
    # head_count_kv written per layer, 0 for a layer without attention (how llama.cpp's
    # lfm2 tells its convolution layers); otherwise one count for every layer.
    gguf_kv_heads_per_layer: bool = False
    # Metadata keys its files give per layer (an array), which gguf_read_keys reads
    # (the common reader takes the first layer's): Gemma 4's feed_forward_length and
    # attention.head_count_kv.
    gguf_per_layer_keys: tuple[str, ...] = ()
    # Its files' rope_freqs tensor marks which rotary pairs turn, which gguf_read_keys
    # reads (Gemma 4's proportional rope); elsewhere it scales frequencies (Llama 3.1's
    # kind), which the reader refuses.
    gguf_rope_freqs: bool = False
    # A mixture as llama.cpp's graph runs it: the picked experts' weights renormalized
    # (not for Qwen2-MoE); a shared expert.
    gguf_renormalizes_experts: bool = True
    gguf_shared_expert: bool = False
    # Its files' first layers may be dense (``leading_dense_block_count``: LFM2-MoE);
    # otherwise llama.cpp's graph makes every layer a mixture.
    gguf_leading_dense: bool = False
    # What the family adds to the config read from a file's metadata, ``(reader,
    # config dict)`` (reader: gguf_checkpoint.GGUFCheckpoint); and what it checks and
    # writes beyond the common keys when exported, ``(gguf.GGUFWriter, ModelConfig)``.
    gguf_read_keys: Callable[[Any, dict[str, Any]], None] | None = None
    gguf_write_keys: Callable[[Any, Any], None] | None = None
    # What the family changes in a checkpoint tensor as it is written, ``(hf name,
    # float tensor, ModelConfig) -> (hf name to write it as, or None to leave it out;
    # tensor)``: the inverse of how its model reads the file (Qwen3.5's delta nets).
    gguf_write_tensor: Callable[[str, Any, Any], tuple[str | None, Any]] | None = None
    # Float32 tensors its files hold beyond the checkpoint's, ``ModelConfig -> {GGUF
    # name: array}``, written by tandem's writers (Gemma 4's rope_freqs).
    gguf_extra_tensors: Callable[[Any], dict[str, Any]] | None = None
    # Tensor parallelism: its modules are the ones models/sharding.py's LAYOUT names.
    tensor_parallel: bool = False
    # Its decoder layers offer runner/fused_decode.py's hook (``attn.decode_layer``,
    # ``attn.decode_stack``): decode steps on the CPU's quantized path run a layer, or
    # all of them, in one compiled call. Without it every layer runs as PyTorch calls.
    fused_decode: bool = False

    @property
    def exported_as(self) -> str | None:
        return self.gguf_export_as or self.gguf_architecture
