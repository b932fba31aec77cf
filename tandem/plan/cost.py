"""StepCostModel: how long one engine step takes, from what it runs.

A step runs a flat batch: each scheduled request contributes its new tokens (a prefill
chunk, one decode token, or one plus its speculative slots) on top of the context it
already has in the cache. The model is the roofline with fixed costs:

    bytes  = weights (read once per step) + KV per token x sum(context + new tokens)
    flops  = 2 x params x new tokens  +  attention: 4 x layers x heads x head_dim x
             sum over requests of new x (context + (new + 1) / 2)

A mixture of experts reads, of its experts' weights, the experts its step's tokens
picked: for T tokens each picking k of E experts, E x (1 - (1 - k / E)^T) of them a
layer on average (``expected_experts``: uniform routing), so its step's bytes grow
with the batch until every expert is read; each token's flops are the non-expert
weights' plus k experts'.
    step   = overhead + layers x layer_overhead + requests x request_overhead
             + tokens x token_overhead + max(bytes / bandwidth, flops / peak)

The per-request and per-token terms are the host's work for each request in the
batch (scheduling, sampling, outputs) and for each token it runs (embedding, the
small ops between matmuls): on a CPU with a small model they are most of a decode
step, and without them no roofline fits the measured steps.

The coefficients come from a datasheet (``from_hardware``: the `tandem plan` presets,
no overheads) or are fitted to real steps measured on this machine (``fit``: a
least-squares fit of the same form, `tandem plan --measure --calibrate FILE`), and
are saved as JSON. A KV transfer (disaggregated serving) costs ``latency + bytes /
link bandwidth`` (``transfer_seconds``). Under tensor parallelism every step also
pays its collectives (``collective_seconds``): two all-reduces of the step's hidden
states per layer and the gather of the sampled rows' logits, each a latency plus
bytes over the link between ranks. A served request also spends ``frontend_s``
outside the engine (fitted by `tandem plan --calibrate --from-trace` from a serving
run; calibrate.py).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.models.config import ModelConfig

# One request's share of a step: (new tokens, tokens already in its cache).
Share = tuple[int, int]


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a step depends on, of a model in a dtype."""

    params: int
    weight_bytes: float
    kv_bytes_per_token: float
    num_layers: int
    attention_width: int  # query heads x head dim
    hidden_size: int = 0  # (the tensor-parallel collectives' message: a token's state)
    vocab_size: int = 0
    activation_bytes: float = 4.0
    # A mixture of experts: the share of params (and of weight bytes) in experts, and
    # each layer's experts and how many a token picks.
    expert_share: float = 0.0
    experts: int = 0
    experts_per_token: int = 0
    # An expert's intermediate size, and the weights of its tensors' blocks (1: float):
    # whether tensor-parallel ranks split every expert (models/sharding.py).
    expert_intermediate: int = 0
    expert_block: int = 1

    @classmethod
    def of(
        cls, config: ModelConfig, params: int, bytes_per_weight: float, kv_bytes: float,
        expert_block: int = 1,
    ):  # fmt: skip
        """``kv_bytes``: the element size of the cache and of the activations;
        ``expert_block``: the weights a block of the experts' tensors holds."""
        moe = config.moe
        return cls(
            params,
            params * bytes_per_weight,
            config.kv_bytes_per_token(kv_bytes),
            config.num_layers,
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.vocab_size,
            kv_bytes,
            config.expert_parameters() / params if params else 0.0,
            moe.num_experts if moe else 0,
            moe.top_k if moe else 0,
            moe.intermediate_size if moe else 0,
            expert_block,
        )

    def experts_split(self, ranks: int) -> bool:
        """Whether ``ranks`` tensor-parallel ranks split every expert (the engine's
        default where it can) rather than each holding whole experts."""
        from tandem.models.sharding import splits_experts

        return bool(self.experts) and splits_experts(
            self.expert_intermediate, self.expert_block, ranks
        )

    def read_share(self, tokens: float, ranks: int = 1) -> float:
        """The share of the weights a step of ``tokens`` tokens reads (1 for a dense
        model; a mixture reads the experts its tokens picked; on ``ranks`` ranks holding
        whole experts, as if each read as many as the busiest: expert_read_share)."""
        if not self.experts:
            return 1.0
        share = expert_read_share(
            self.experts, self.experts_per_token, tokens, ranks, self.experts_split(ranks)
        )
        return 1 - self.expert_share + self.expert_share * share

    @property
    def active_params(self) -> float:
        """The weights one token multiplies."""
        if not self.experts:
            return self.params
        return self.params * (1 - self.expert_share * (1 - self.experts_per_token / self.experts))

    def step_bytes(self, shares: list[Share], ranks: int = 1) -> float:
        """A step's reads; on ``ranks`` ranks, their sum as if each read what the
        busiest did (read_share)."""
        tokens = sum(n for n, _ in shares)
        weights = self.weight_bytes * self.read_share(tokens, ranks)
        return weights + self.kv_bytes_per_token * sum(n + c for n, c in shares)

    def step_flops(self, shares: list[Share]) -> float:
        tokens = sum(n for n, _ in shares)
        attention = sum(n * (c + (n + 1) / 2) for n, c in shares)
        dense = 2 * self.active_params * tokens
        return dense + 4 * self.num_layers * self.attention_width * attention


def expected_experts(experts: int, per_token: int, tokens: int) -> float:
    """The distinct experts a layer reads for ``tokens`` tokens, each picking
    ``per_token`` of ``experts`` (on average, every expert equally likely):
    experts x (1 - (1 - per_token / experts)^tokens)."""
    if tokens <= 0:
        return 0.0
    return experts * (1 - (1 - per_token / experts) ** tokens)


@functools.lru_cache(maxsize=256)
def busiest_rank_experts(experts: int, per_token: int, tokens: int, ranks: int) -> float:
    """Under expert parallelism (``ranks`` ranks, each holding a run of the experts as
    models/sharding.py splits them), the distinct experts the busiest rank reads in a
    layer for ``tokens`` tokens each picking ``per_token`` of ``experts`` (uniform
    routing), on average. The ranks wait for each other at the layer's all-reduce, so
    the busiest one sets the step: at batch 1 on 2 ranks a 30B-A3B layer's busiest
    rank reads 5.1 of the token's 8 experts, not 4. One rank: ``expected_experts``.

    From 4 tokens on, each expert is taken as read independently, with probability
    p = 1 - (1 - k/E)^T, so a rank holding n reads Binomial(n, p) of them and the
    busiest E[max] = sum over m >= 1 of 1 - prod over ranks of P(X_r < m) (exact under
    that assumption; within 0.3% of drawn batches from 4 tokens). Below 4 a token's k
    picks are too dependent for it (3% high at batch 1): the mean over seeded random
    draws of the picks instead."""
    if tokens <= 0:
        return 0.0
    if ranks <= 1:
        return expected_experts(experts, per_token, tokens)
    from tandem.models.sharding import split_evenly

    held = [len(split_evenly(experts, ranks, r)) for r in range(ranks)]
    if tokens >= 4:
        p = 1 - (1 - per_token / experts) ** tokens

        def below(n: int, m: int) -> float:  # P(Binomial(n, p) < m)
            return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(min(m, n + 1)))

        return sum(1 - math.prod(below(n, m) for n in held) for m in range(1, max(held) + 1))
    import numpy as np

    owner = np.repeat(np.arange(ranks), held)
    draws = 1_000_000 // (tokens * experts) + 64
    rng = np.random.default_rng(0)
    busiest = 0.0
    for _ in range(4):  # in slices, to bound the draws' memory
        keys = rng.random((draws, tokens, experts))
        picked = np.argpartition(keys, per_token - 1, axis=-1)[..., :per_token]
        read = np.zeros((draws, experts), dtype=bool)
        np.put_along_axis(read, picked.reshape(draws, -1), True, axis=-1)
        per_rank = np.stack([read[:, owner == r].sum(-1) for r in range(ranks)], -1)
        busiest += per_rank.max(-1).mean() / 4
    return float(busiest)


def expert_read_share(
    experts: int, per_token: int, tokens: float, ranks: int = 1, split: bool = False
) -> float:
    """The share of a mixture's expert weights a step of ``tokens`` reads; on ``ranks``
    ranks each holding a run of the experts, as if every rank read as many as the
    busiest one, which the others wait for: the step's time at the ranks' summed
    bandwidth. ``split``: every rank holds its columns of every expert
    (models/sharding.py), so each reads its share of the same picked experts. ``tokens``
    may be fractional (a batch found by iteration): between the whole batches around it."""
    if ranks <= 1 or tokens <= 0 or split:
        return expected_experts(experts, per_token, tokens) / experts
    low = max(1, math.floor(tokens))
    at = [busiest_rank_experts(experts, per_token, n, ranks) for n in (low, low + 1)]
    busiest = at[0] + (at[1] - at[0]) * min(1.0, max(0.0, tokens - low))
    return min(1.0, busiest * ranks / experts)


@dataclass(frozen=True)
class StepCostModel:
    bandwidth_gbs: float
    tflops: float
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    # A served request's time outside the engine (HTTP, tokenization, the hop to the
    # engine core and back), paid once per call to an instance: the simulator adds it
    # to each request's TTFT and E2EL. 0 for an engine driven in process.
    frontend_s: float = 0.0
    source: str = ""  # "datasheet: <preset>", or "fitted to N steps on <machine>"
    # Tensor parallelism: ranks, and the link between them (collective_seconds).
    tp: int = 1
    link_gbs: float = float("inf")
    link_latency_s: float = 0.0

    @classmethod
    def from_hardware(
        cls, hardware, dtype: str, tp: int = 1, link: tuple[float, float] | None = None
    ) -> StepCostModel:
        """A datasheet's roofline (no overheads: a floor, not a prediction), over ``tp``
        devices whose collectives cross ``link`` (GB/s, seconds; default: the
        hardware's)."""
        link_gbs, latency_s = link or hardware.link()
        return cls(
            hardware.bandwidth_gbs * tp,
            hardware.flops_for(dtype) * tp,
            source=f"datasheet: {hardware.name}",
            tp=tp,
            link_gbs=link_gbs,
            link_latency_s=latency_s,
        )

    def step_seconds(self, shape: ModelShape, shares: list[Share]) -> float:
        """One step running ``shares`` (each request's new tokens and context)."""
        if not shares:
            return 0.0
        memory = shape.step_bytes(shares, self.tp) / (self.bandwidth_gbs * 1e9)
        compute = shape.step_flops(shares) / (self.tflops * 1e12)
        fixed = self.step_overhead_s + shape.num_layers * self.layer_overhead_s
        host = len(shares) * self.request_overhead_s + sum(n for n, _ in shares) * (
            self.token_overhead_s
        )
        collectives = collective_seconds(
            shape, sum(n for n, _ in shares), len(shares), self.tp, self.link_gbs,
            self.link_latency_s,
        )  # fmt: skip
        return fixed + host + max(memory, compute) + collectives

    @classmethod
    def fit(
        cls, shape: ModelShape, samples: list[tuple[list[Share], float]], source: str = ""
    ) -> StepCostModel:
        """The coefficients that best explain measured steps (``samples``: the shares
        of a step and its seconds), minimising the squared relative error with every
        cost non-negative (a term whose best value would be negative is dropped: noisy
        steps can ask for that, and a model that cannot hold a negative cost must not
        be fitted with one: a negative fixed cost clamped to 0 after the fit
        mispredicts every step).

        A step is memory-bound exactly when its FLOPs per byte are below the machine's
        ridge point (peak / bandwidth), so the steps sorted by that ratio split into a
        memory-bound head and a compute-bound tail. For every split the problem is
        linear, t = c0 + c1 x requests + c2 x tokens + c3 x bytes [head] + c4 x flops
        [tail], and solved by least squares; the split with the smallest error wins. The fixed
        cost is one number (a model's layer overhead cannot be told apart from its
        step's): it is reported as step overhead."""
        if len(samples) < 3:
            raise ValueError("fitting needs at least three measured steps")
        bytes_ = torch.tensor([shape.step_bytes(s) for s, _ in samples], dtype=torch.float64)
        flops = torch.tensor([shape.step_flops(s) for s, _ in samples], dtype=torch.float64)
        requests = torch.tensor([len(s) for s, _ in samples], dtype=torch.float64)
        tokens = torch.tensor([sum(n for n, _ in s) for s, _ in samples], dtype=torch.float64)
        seconds = torch.tensor([t for _, t in samples], dtype=torch.float64)
        weight = 1.0 / seconds
        order = torch.argsort(flops / bytes_)
        best_error, best = float("inf"), torch.zeros(5, dtype=torch.float64)
        # Every split of a sweep; some 200 of a serving trace's thousands of steps.
        splits = (
            sorted({round(i * len(samples) / 200) for i in range(201)})
            if len(samples) > 200
            else range(len(samples) + 1)
        )
        for split in splits:
            memory_bound = torch.zeros(len(samples), dtype=torch.bool)
            memory_bound[order[:split]] = True
            columns = torch.stack(
                [
                    torch.ones_like(bytes_), requests, tokens,
                    bytes_ * memory_bound, flops * ~memory_bound,
                ], 1,
            )  # fmt: skip
            solution = _nonnegative_lstsq(columns, seconds, weight)
            error = float((((columns @ solution) - seconds) * weight).square().sum())
            if error < best_error:
                best_error, best = error, solution
        overhead, per_request, per_token, per_byte, per_flop = (float(v) for v in best)
        # A bound that no measured step reached stays unknown: infinitely fast.
        bandwidth = 1 / per_byte / 1e9 if per_byte > 0 else float("inf")
        tflops = 1 / per_flop / 1e12 if per_flop > 0 else float("inf")
        return cls(bandwidth, tflops, overhead, 0.0, per_request, per_token, source=source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        return cls(**json.loads(Path(path).read_text()))


def allreduce_seconds(num_bytes: float, ranks: int, link_gbs: float, latency_s: float) -> float:
    """One all-reduce of ``num_bytes`` among ``ranks``: a small message's latency plus
    the bytes each link carries in a ring, 2 (N - 1) / N of them (nccl-tests' "bus
    bandwidth" convention)."""
    if ranks <= 1:
        return 0.0
    return latency_s + 2 * (ranks - 1) / ranks * num_bytes / (link_gbs * 1e9)


def collective_seconds(
    shape: ModelShape, tokens: int, sampled: int, ranks: int, link_gbs: float, latency_s: float
) -> float:
    """A tensor-parallel step's collectives: per layer, an all-reduce of the ``tokens``'
    hidden states after attention and another after the MLP; then the ``sampled``
    rows' logits gathered from the vocabulary shards (float32)."""
    if ranks <= 1 or tokens == 0:
        return 0.0
    states = tokens * shape.hidden_size * shape.activation_bytes
    layers = 2 * shape.num_layers * allreduce_seconds(states, ranks, link_gbs, latency_s)
    logits = sampled * shape.vocab_size * 4
    gather = latency_s + (ranks - 1) / ranks * logits / (link_gbs * 1e9)
    return layers + gather


def transfer_seconds(num_bytes: float, link_gbs: float, latency_s: float = 0.0) -> float:
    """A KV transfer between instances: latency plus bytes over the link's bandwidth."""
    return latency_s + num_bytes / (link_gbs * 1e9)


def shares_of(scheduled) -> list[Share]:
    """A SchedulerOutput's ``scheduled`` items as shares (speculative slots included)."""
    return [
        (item.num_new_tokens + item.num_spec_tokens, item.num_computed_tokens) for item in scheduled
    ]


def _nonnegative_lstsq(columns: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    """``_weighted_lstsq`` with every coefficient kept >= 0: the most negative one is
    dropped (its column zeroed) and the rest solved again. A column always stays: the
    columns are >= 0 and the times > 0, so a single column's coefficient is > 0."""
    columns = columns.clone()
    while True:
        solution = _weighted_lstsq(columns, target, weight)
        worst = int(torch.argmin(solution))
        if solution[worst] >= 0:
            return solution
        columns[:, worst] = 0


def _weighted_lstsq(columns: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    """Least squares with each row scaled by ``weight`` (relative error with 1/t);
    columns that are all zero get a zero coefficient."""
    used = columns.abs().sum(0) > 0
    solution = torch.zeros(columns.shape[1], dtype=columns.dtype)
    scaled = columns[:, used] * weight[:, None]
    scale = scaled.abs().amax(0)  # conditioning: bytes and FLOPs are 1e6..1e12
    fitted = torch.linalg.lstsq(scaled / scale, (target * weight)[:, None]).solution[:, 0]
    solution[used] = fitted / scale
    return solution
