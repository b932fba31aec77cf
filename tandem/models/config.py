"""ModelConfig: the architecture facts the runner and engine need, whatever the family.

Each model family parses its Hugging Face ``config.json`` into this one shape, so the
runner, the KV cache and (later) the planner never read family-specific keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import ModelLoadError


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``scaling`` holds the type-specific keys."""

    theta: float
    rotary_dim: int
    scaling_type: str = "default"
    scaling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (models/moe.py): ``num_experts`` gated MLPs of
    ``intermediate_size`` each, of which a router picks ``top_k`` per token by softmax
    probability, their outputs summed with those probabilities (renormalized to sum
    to 1 over the picked experts when ``normalize_top_k``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    # Layers with a dense MLP (ModelConfig.intermediate_size) instead (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()
    # A shared expert every token runs beside the picked ones, a gated MLP of this
    # size whose output is scaled by sigmoid(a learned 1-output gate) (Qwen2-MoE's);
    # 0: none. Its weights are always read, so they count as non-expert weights.
    shared_intermediate_size: int = 0
    # gpt-oss: a bias on the router's logits, and on each expert's projections.
    router_bias: bool = False
    expert_bias: bool = False
    # LFM2-MoE (and DeepSeek-V3's kind): each expert's score the sigmoid of its logit, not
    # a softmax; the top k picked by score plus a learned per-expert bias
    # (``selection_bias``: it picks, it does not weigh), their scores renormalized
    # (``normalize_top_k``, the sum plus ``normalize_epsilon``) and scaled by
    # ``routed_scaling``.
    scoring: str = "softmax"
    selection_bias: bool = False
    normalize_epsilon: float = 0.0
    routed_scaling: float = 1.0
    # The experts this process holds, [start, stop) of ``num_experts`` (a
    # tensor-parallel rank's: models/sharding.py); None: every one. The router still
    # scores all of them.
    held_experts: tuple[int, int] | None = None

    @property
    def held(self) -> range:
        return range(*(self.held_experts or (0, self.num_experts)))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    rope: RopeConfig | None
    attention_bias: bool = False  # bias on the q/k/v projections
    attention_out_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # The layers that slide when only some do (Gemma 3: five local layers to each
    # global one); None: every layer slides when sliding_window is set.
    sliding_layers: tuple[int, ...] | None = None
    # dtype the checkpoint was saved in, e.g. "bfloat16"; None when the config is silent.
    checkpoint_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Settings only one family reads (e.g. GPT-2's attention scaling switches).
    family_options: dict[str, Any] = field(default_factory=dict)
    moe: MoEConfig | None = None  # None: every layer's MLP is dense
    # An encoder (BERT): every token attends to every token of its prompt, so a prompt
    # runs whole, keeps no K/V, and makes vectors (embeddings, scores), never tokens.
    encoder: bool = False
    # Hybrids (Qwen3.5's Gated DeltaNet): layers whose token mixer is a recurrence with a
    # fixed-size state per sequence instead of attention. They keep no K/V; each holds,
    # per running sequence, float32 states of the shapes ``recurrent_state`` (one slot of
    # the state cache: runner/state_cache.py).
    recurrent_layers: tuple[int, ...] = ()
    recurrent_state: tuple[tuple[int, ...], ...] = ()
    # Attention layers whose K/V differ in shape from (num_kv_heads, head_dim): layer ->
    # (KV heads, head size) (Gemma 4's full-attention layers: larger heads, fewer of
    # them). Their query heads are num_heads of that size.
    layer_kv_shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Layers that read another layer's K/V and keep none: layer -> the layer whose
    # cache it reads (Gemma 4's last num_kv_shared_layers).
    kv_shared_layers: dict[int, int] = field(default_factory=dict)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the paged cache, in order (an encoder's: none)."""
        if self.encoder:
            return ()
        return tuple(
            i for i in range(self.num_layers)
            if i not in self.recurrent_layers and i not in self.kv_shared_layers
        )  # fmt: skip

    def cache_index(self, layer: int) -> int:
        """Where attention layer ``layer`` keeps its K/V in the cache (its place among the
        layers that keep K/V: a hybrid's recurrent layers take none; a layer reading
        another's K/V reads that layer's place)."""
        layer = self.kv_shared_layers.get(layer, layer)
        if self.recurrent_layers or self.kv_shared_layers:
            return self.kv_layers.index(layer)
        return layer

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of attention layer ``layer``."""
        return self.layer_kv_shapes.get(layer, (self.num_kv_heads, self.head_dim))

    def cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """(KV heads, head size) of each place in the cache, by cache index."""
        return tuple(self.kv_shape(layer) for layer in self.kv_layers)

    def state_bytes_per_sequence(self) -> int:
        """The state cache's bytes for one sequence: every recurrent layer's states,
        float32. The one formula the runner sizes its slots with and the planner
        reports."""
        one = sum(math.prod(shape) for shape in self.recurrent_state)
        return 4 * one * len(self.recurrent_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def expert_parameters(self) -> int:
        """The weights of every expert of every sparse layer (gate, up and down); a
        token reads top_k / num_experts of them."""
        if self.moe is None:
            return 0
        layers = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        per_expert = 3 * self.hidden_size * self.moe.intermediate_size
        return layers * self.moe.num_experts * per_expert

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each K/V layer's sliding window, by cache index (None: the layer attends its
        whole context)."""
        layers = (
            self.kv_layers if self.recurrent_layers or self.kv_shared_layers
            else range(self.num_layers)
        )  # fmt: skip
        if self.sliding_window is None:
            return (None,) * len(layers)
        sliding = range(self.num_layers) if self.sliding_layers is None else self.sliding_layers
        return tuple(self.sliding_window if i in sliding else None for i in layers)

    def layer_window(self, layer: int) -> int | None:
        """Attention layer ``layer``'s sliding window (None: it attends everything); a
        layer reading another's K/V has its source's."""
        return self.layer_windows()[self.cache_index(layer)]

    def kv_bytes_per_token(
        self, bytes_per_element: float, tp: int = 1, row_extra_bytes: int = 0
    ) -> float:
        """KV cache bytes one token takes (on one of ``tp`` tensor-parallel ranks): K and
        V, every layer that keeps them, the KV heads of the rank, each head's row its
        values and ``row_extra_bytes`` (an int8 row's scale). The one formula the runner
        sizes its cache with and the planner reports. An encoder keeps none."""
        if self.encoder:
            return 0.0
        total = 0.0
        for heads, head_dim in self.cache_shapes():
            heads_per_rank = max(1, math.ceil(heads / tp))
            total += 2 * heads_per_rank * (head_dim * bytes_per_element + row_extra_bytes)
        return total


def require(raw: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present in ``raw``; a clear error when none is."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    names = " or ".join(repr(k) for k in keys)
    raise ModelLoadError(f"config.json has no {names} (architecture {architecture_of(raw)})")


def architecture_of(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    return architectures[0] if architectures else "<none>"


def eos_ids(value: Any) -> tuple[int, ...]:
    """eos_token_id may be an int, a list of ints, or absent."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    # transformers 5 writes "dtype", earlier versions "torch_dtype".
    return raw.get("dtype") or raw.get("torch_dtype")


def parse_rope(raw: dict[str, Any], head_dim: int) -> RopeConfig:
    """Read rope settings in both the old (rope_theta + rope_scaling) and new
    (rope_parameters, transformers >= 5) spellings of config.json."""
    params = dict(raw.get("rope_parameters") or {})
    old_scaling = raw.get("rope_scaling") or {}
    params = {**old_scaling, **params}
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    scaling_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * partial)
    if scaling_type == "proportional":
        # (Gemma 4: the whole head turns, its first partial / 2 pairs at the frequencies
        # of a head_dim rotary, the others not at all: layers.rope_inv_freq)
        params["partial_rotary_factor"] = partial
        rotary_dim = head_dim
    supported = ("default", "linear", "dynamic", "llama3", "yarn", "proportional")
    if scaling_type not in supported:
        raise ModelLoadError(
            f"rope scaling type {scaling_type!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )
    return RopeConfig(float(theta), rotary_dim, scaling_type, params)
