"""Which slice of every weight one tensor-parallel rank holds (Megatron's layout).

    q/k/v, gate/up   column-parallel: a rank's rows (its heads, its share of the MLP;
                     of GPT-2's fused c_attn, its rows of each of q, k and v); an
                     attention's own per-head parameters (gpt-oss's sinks) its heads
    o, down          row-parallel: the matching columns; the ranks' outputs are partial
                     sums, added by an all-reduce (runner/linear/parallel.py)
    embedding, head  vocabulary-parallel: a rank's rows of the vocabulary (lookups
                     all-reduced, logits gathered)
    experts          every routed expert split as an MLP is (its gate/up rows, its
                     down projection's matching columns: partial sums), where its
                     intermediate size cuts into equal runs of whole blocks: each
                     rank then does the same share of every picked expert, so the
                     ranks finish a layer together (vLLM's and SGLang's default);
                     else, or with ``expert_parallel``, expert-parallel: a rank
                     holds a run of whole experts, and waits on the rank that holds
                     more of a step's picks (at batch 1 on 2 ranks a 30B-A3B layer's
                     busiest rank has 5.1 of a token's 8, not 4). A mixture's shared
                     expert is split as an MLP; the mixture's partial sums (routed
                     and shared) are all-reduced once (models/moe.py)
    everything else  (norms, routers, biases of row-parallel and partial-sum layers:
                     added once, by rank 0) whole on every rank

Heads are split by KV groups, so that a rank's query heads read only its own KV
heads: with at least as many KV heads as ranks each rank takes a run of whole groups
(uneven where they do not divide: SmolLM2's 3 KV heads on 2 ranks are 2 + 1, its 9
query heads 6 + 3); with fewer, each KV head is copied to several ranks and its
group's query heads split between them. A block-quantized tensor is cut on whole
blocks along its columns and whole packed tiles along its rows.

Pure arithmetic on the ModelConfig: the model files never learn about ranks; the
loader narrows each checkpoint tensor (``ShardPlan.narrow``) and builds the model
from ``ShardPlan.config``, and the runner adds the collectives.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.registry import FAMILIES, family_of
from tandem.models.weight_source import CheckpointTensor
from tandem.quant.blocks import BLOCK
from tandem.quant.packed import ROWS

COLUMN, ROW, VOCAB = "column", "row", "vocab"
# Row-parallel whose partial sums a later collective completes (a shared expert's
# down projection: its mixture all-reduces once, models/moe.py), so none of its own.
PARTIAL = "partial"

# Module name (its last one or two components) -> (how it is split, the unit of each
# fused part's rows or its columns). A checkpoint tensor that holds every part at once
# (GPT-2's c_attn: q, k, v) gives the rank its share of each, in order.
LAYOUT: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": (COLUMN, ("q", "kv", "kv")),
    "gate_up_proj": (COLUMN, ("mlp", "mlp")),
    "o_proj": (ROW, ("q",)),
    "down_proj": (ROW, ("mlp",)),
    "shared_expert.gate_up_proj": (COLUMN, ("shared", "shared")),
    "shared_expert.down_proj": (PARTIAL, ("shared",)),
    "self_attn": (COLUMN, ("heads",)),  # (parameters of the attention itself: sinks)
    "embed_tokens": (VOCAB, ("vocab",)),
    "lm_head": (VOCAB, ("vocab",)),
    # GPT-2
    "c_attn": (COLUMN, ("q", "kv", "kv")),
    "attn.c_proj": (ROW, ("q",)),
    "c_fc": (COLUMN, ("mlp",)),
    "mlp.c_proj": (ROW, ("mlp",)),
    "wte": (VOCAB, ("vocab",)),
}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's module, by its number
# A routed expert's matrices where the ranks split every expert ("expert": its
# intermediate columns); its down projection's sums are the mixture's to complete.
EXPERT_LAYOUT: dict[str, tuple[str, tuple[str, ...]]] = {
    "gate_up_proj": (COLUMN, ("expert", "expert")),
    "down_proj": (PARTIAL, ("expert",)),
}


def splits_experts(intermediate_size: int, block: int, size: int) -> bool:
    """Whether ``size`` ranks split every routed expert (its intermediate columns in
    equal runs of whole ``block``s: the file's blocks of its experts' tensors) rather
    than each holding whole experts; ShardPlan.split_experts, unless expert
    parallelism is asked for. tandem plan and simulate price the same choice."""
    return size > 1 and intermediate_size % (block * size) == 0


def is_routed_expert(name: str) -> bool:
    """Whether a module or parameter name is a routed expert's."""
    return _EXPERT.search(name + ".") is not None


def layout_of(module_name: str, split_experts: bool = False) -> tuple[str, tuple[str, ...]] | None:
    """How ``module_name`` is split (LAYOUT; a routed expert's matrices where the
    ranks split every expert: EXPERT_LAYOUT), or None: whole on the ranks that hold
    it (a routed expert's matrices where each rank holds whole experts)."""
    parts = module_name.split(".")
    if is_routed_expert(module_name):
        return EXPERT_LAYOUT.get(parts[-1]) if split_experts else None
    return LAYOUT.get(".".join(parts[-2:])) or LAYOUT.get(parts[-1])


def split_evenly(total: int, parts: int, index: int, unit: int = 1) -> range:
    """Part ``index`` of ``total`` cut into ``parts`` runs of whole ``unit``s, the
    first ones a unit longer where they do not divide (the last may end on a partial
    unit when ``total`` is not whole units)."""
    units = -(-total // unit)
    size, extra = divmod(units, parts)
    start = index * size + min(index, extra)
    stop = start + size + (index < extra)
    return range(min(start * unit, total), min(stop * unit, total))


def vocab_rows(vocab_size: int, size: int, rank: int) -> range:
    """The embedding and LM head rows of ``rank``: whole packed tiles."""
    return split_evenly(vocab_size, size, rank, ROWS)


def head_ranges(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of ``rank`` out of ``size`` (the module's docstring)."""
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{num_heads} query heads are not whole groups of {num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = split_evenly(num_kv_heads, size, rank)
        return range(kv.start * group, kv.stop * group), kv
    kv_head = next(h for h in range(num_kv_heads) if rank in split_evenly(size, num_kv_heads, h))
    sharers = split_evenly(size, num_kv_heads, kv_head)
    if len(sharers) > group:
        raise ModelLoadError(
            f"tensor-parallel size {size} leaves a rank without attention heads "
            f"({num_heads} query heads in {num_kv_heads} groups of {group})"
        )
    q = split_evenly(group, len(sharers), rank - sharers.start)
    first = kv_head * group
    return range(first + q.start, first + q.stop), range(kv_head, kv_head + 1)


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size``: its ranges of heads, MLP columns and vocabulary."""

    full: ModelConfig
    rank: int
    size: int
    # The weights a quantized block of the file holds (its largest format's): MLP
    # columns are cut on whole blocks, so that a quantized down projection splits.
    block: int = 1
    # The same for a mixture's routed experts' tensors (their columns are cut on
    # their own blocks: a Q4_0 file's experts in 32s beside its Q6_K output matrix).
    expert_block: int = 1
    # A mixture's experts whole, a run of them on each rank, even where every expert
    # could be split (``split_experts``).
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not family_of(self.full.architecture).tensor_parallel:  # (LAYOUT names its modules)
            splits = ", ".join(n for f in FAMILIES if f.tensor_parallel for n in f.architectures)
            raise ModelLoadError(
                f"tensor parallelism does not split {self.full.architecture} yet "
                f"(it splits {splits})"
            )
        full, moe = self.full, self.full.moe
        dense = any(not full.is_moe_layer(i) for i in range(full.num_layers))
        mlps = [full.intermediate_size] * dense + ([moe.shared_intermediate_size] if moe else [])
        for columns in mlps:
            if columns and -(-columns // self.block) < self.size:
                raise ModelLoadError(
                    f"an MLP of {columns} columns in blocks of {self.block} "
                    f"cannot be split across {self.size} tensor-parallel ranks"
                )
        if moe is not None and not self.split_experts and moe.num_experts < self.size:
            raise ModelLoadError(
                f"{moe.num_experts} experts cannot be split across {self.size} "
                "tensor-parallel ranks (each rank holds whole experts)"
            )

    @property
    def split_experts(self) -> bool:
        """Whether every rank holds its share of every routed expert (each expert's
        intermediate size in equal runs of whole blocks, expert parallelism not asked
        for) rather than a run of whole experts."""
        moe = self.full.moe
        return (
            moe is not None
            and not self.expert_parallel
            and splits_experts(moe.intermediate_size, self.expert_block, self.size)
        )

    @property
    def heads(self) -> tuple[range, range]:
        return head_ranges(self.full.num_heads, self.full.num_kv_heads, self.size, self.rank)

    @property
    def ranges(self) -> dict[str, range]:
        """Each unit's range in a weight's rows or columns: the rank's query and KV
        heads' rows, its MLP columns (whole blocks of the file: ``block``) and its vocabulary
        rows (whole packed tiles); of a mixture, its shared expert's columns (as the
        MLP's), its experts (all, or a run of whole ones) and, where every expert is
        split, its columns of each ("expert")."""
        q, kv = self.heads
        d, moe = self.full.head_dim, self.full.moe
        ranges = {
            "heads": q,
            "q": range(q.start * d, q.stop * d),
            "kv": range(kv.start * d, kv.stop * d),
            "mlp": split_evenly(self.full.intermediate_size, self.size, self.rank, self.block),
            "vocab": vocab_rows(self.full.vocab_size, self.size, self.rank),
        }
        if moe is not None:
            shared = moe.shared_intermediate_size
            ranges["shared"] = split_evenly(shared, self.size, self.rank, self.block)
            if self.split_experts:
                ranges["experts"] = range(moe.num_experts)
                ranges["expert"] = split_evenly(
                    moe.intermediate_size, self.size, self.rank, self.expert_block
                )
            else:
                ranges["experts"] = split_evenly(moe.num_experts, self.size, self.rank)
        return ranges

    @property
    def vocab(self) -> range:
        return self.ranges["vocab"]

    @property
    def config(self) -> ModelConfig:
        """The rank's model: its heads and MLP columns (the vocabulary stays whole in
        the config; the embedding and head are cut by ``shard_model``); of a mixture,
        its experts (or its columns of each) and its shared expert's columns."""
        q, kv = self.heads
        ranges, moe = self.ranges, self.full.moe
        if moe is not None:
            experts = ranges["experts"]
            moe = dataclasses.replace(
                moe,
                held_experts=(experts.start, experts.stop),
                shared_intermediate_size=len(ranges["shared"]),
                intermediate_size=len(ranges.get("expert", range(moe.intermediate_size))),
            )
        return dataclasses.replace(
            self.full,
            num_heads=len(q),
            num_kv_heads=len(kv),
            intermediate_size=len(ranges["mlp"]),
            moe=moe,
        )

    def holds(self, param_name: str) -> bool:
        """Whether this rank has ``param_name`` at all (a routed expert's weights only
        on the rank that holds the expert; everything else on every rank)."""
        found = _EXPERT.search(param_name)
        return found is None or int(found.group(1)) in self.ranges["experts"]

    def full_width(self, unit: str) -> int:
        """A unit's rows (or columns) in the whole model."""
        c = self.full
        return {
            "heads": c.num_heads,
            "q": c.num_heads * c.head_dim,
            "kv": c.num_kv_heads * c.head_dim,
            "mlp": c.intermediate_size,
            "vocab": c.vocab_size,
            "shared": c.moe.shared_intermediate_size if c.moe else 0,
            "expert": c.moe.intermediate_size if c.moe else 0,
        }[unit]

    def narrow(self, param_name: str, part: int | None, tensor: CheckpointTensor, transposed=False):
        """This rank's slice of a checkpoint tensor bound for ``param_name`` (its fused
        ``part``, or all of its parts when ``part`` is None and the layout fuses
        several); the tensor itself where the rank holds it whole. ``transposed``: the
        file stores the matrix as [in, out] (GPT-2's Conv1D)."""
        module_name, _, kind = param_name.rpartition(".")
        layout = layout_of(module_name, self.split_experts)
        if layout is None:
            return tensor
        how, units = layout
        if how in (ROW, PARTIAL) and kind == "bias":
            return tensor  # added once (rank 0 keeps it: runner/linear/parallel.py)
        dim = 1 if how in (ROW, PARTIAL) else 0
        if transposed and len(tensor.shape) == 2:
            dim = 1 - dim
        ranges = self.ranges
        if part is not None or len(units) == 1:
            return _narrow(tensor, dim, ranges[units[part or 0]])
        spans, offset = [], 0
        for unit in units:  # the parts lie one after another in the tensor
            own = ranges[unit]
            spans.append(range(offset + own.start, offset + own.stop))
            offset += self.full_width(unit)
        return tensor.take(dim, spans)


def _narrow(tensor: CheckpointTensor, dim: int, span: range) -> CheckpointTensor:
    if tensor.quantized and dim == len(tensor.shape) - 1:
        weights = BLOCK[tensor.type][0]
        if span.start % weights or span.stop % weights:
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {tensor.file}: columns {span.start}-{span.stop} "
                f"of a tensor-parallel shard do not fall on its {weights}-weight blocks"
            )
    return tensor.narrow(dim, span.start, len(span))


def parallel_style(module_name: str, split_experts: bool = False) -> str | None:
    """COLUMN, ROW, PARTIAL or VOCAB for a module LAYOUT splits, else None (whole)."""
    layout = layout_of(module_name, split_experts)
    return layout[0] if layout else None


def shard_model(model: nn.Module, plan: ShardPlan) -> None:
    """Cut the embedding and the LM head of ``model`` (built on meta from
    ``plan.config``) to the rank's vocabulary rows; record each split layer's style
    (``tp_style``) for the runner's collectives."""
    vocab = plan.vocab
    for name, module in model.named_modules():
        style = parallel_style(name, plan.split_experts)
        if style is None:
            continue
        module.tp_style = style
        if style != VOCAB:
            continue
        full = module.weight
        module.weight = nn.Parameter(full.new_empty(len(vocab), full.shape[1]), False)
        if isinstance(module, nn.Embedding):
            module.num_embeddings = len(vocab)
        else:
            module.out_features = len(vocab)
