"""A mixture-of-experts MLP: a router picks each token's experts, only they run.

    route     logits = gate(x) [T, experts] (plus a bias: gpt-oss); softmax in
              float32; the top k experts of each token and their probabilities
              (renormalized over the k when the family says so: the same as a softmax
              over the k logits, gpt-oss's), in the model's dtype. Or (LFM2-MoE) the
              sigmoid of each logit, the top k of those plus a per-expert selection
              bias, their sigmoids renormalized and scaled (MoEConfig.scoring)
    experts   each a gated MLP (its own Linear layers: a block-quantized file's
              experts stay in their formats and run on the packed kernels); the
              batch's token slots are grouped by expert, and each expert that was
              picked runs once over its tokens, so only picked experts' weights are
              read: a 128-expert, top-8 layer reads 8 experts' bytes for one token
    combine   each expert's output times its routing weight, added into its tokens'
              rows (experts in order: the same sum as transformers')
    shared    where the family has one (Qwen2-MoE), a shared expert runs on every
              token, scaled by sigmoid(shared_expert_gate(x)), added last

``expert_load`` is the last forward's token count per expert (the step trace and the
metrics read it).

Tensor parallelism (models/sharding.py): a rank holds its share of every expert's
columns (the config's ``intermediate_size`` is then the rank's), or, with expert
parallelism, a run of whole experts (``moe.held``), and the shared expert's share of
columns; it routes over all of them. Its output is then a partial sum (its part of
each picked expert, or the picked experts it holds; its part of the shared one), and
``all_reduce`` (the runner's collective) completes it, as after a row-parallel layer.
``experts`` is keyed by the expert's number in the whole model, so a parameter's name
is the checkpoint's on every rank.

On a CPU with the compiled kernels and packed experts, the runner gives the layer
``fused_experts``: the same computation in one kernel call after the router
(runner/linear/experts.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from tandem.kernels import cpu as cpu_kernels
from tandem.models.config import ModelConfig
from tandem.models.linear import Linear


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, make_expert: Callable[[ModelConfig], nn.Module]):
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.normalize = moe.normalize_top_k
        self.scoring, self.routed_scaling = moe.scoring, moe.routed_scaling
        self.normalize_epsilon = moe.normalize_epsilon
        # (picks, does not weigh: LFM2-MoE's expert_bias)
        self.expert_bias = (
            nn.Parameter(torch.empty(moe.num_experts)) if moe.selection_bias else None
        )
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=moe.router_bias)
        expert = dataclasses.replace(
            config, intermediate_size=moe.intermediate_size, mlp_bias=moe.expert_bias, moe=None
        )
        self.held = moe.held
        self.experts = nn.ModuleDict({str(e): make_expert(expert) for e in self.held})
        self.shared_expert: nn.Module | None = None
        if moe.shared_intermediate_size:
            shared = dataclasses.replace(expert, intermediate_size=moe.shared_intermediate_size)
            self.shared_expert = make_expert(shared)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self._expert_load: list[int] | torch.Tensor = []
        # The sum over a tensor-parallel group's ranks, in place (the runner sets it);
        # None: this process holds every expert.
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    @property
    def expert_load(self) -> list[int]:
        """The last forward's token count per expert. The whole-layer decode call
        (runner/fused_decode.py) writes it into an int64 table, converted here."""
        load = self._expert_load
        return load.tolist() if isinstance(load, torch.Tensor) else load

    @expert_load.setter
    def expert_load(self, load: list[int] | torch.Tensor) -> None:
        self._expert_load = load

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, top_k] routing weights in x's dtype, [T, top_k] expert ids). On a CPU
        with the compiled kernels, their moe_route: the same math, and the routing the
        fused experts' call does, so that the two agree bit for bit."""
        logits = self.gate(x)
        if self.scoring == "sigmoid":
            return self._sigmoid_route(logits, x.dtype)
        if cpu_kernels.usable(logits):
            weights, chosen = cpu_kernels.load().moe_route(logits, self.top_k, self.normalize)
            return weights.to(x.dtype), chosen
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def _sigmoid_route(self, logits: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(logits.float())
        picking = scores if self.expert_bias is None else scores + self.expert_bias.float()
        chosen = torch.topk(picking, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.normalize_epsilon)
        return (weights * self.routed_scaling).to(dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def routed(
        self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The picked experts' weighted sum (the shared expert apart), of the experts
        this process holds; ``routing``: (weights, experts) routed from another input
        than the experts' (Gemma 4's), else ``route(x)``."""
        fused = getattr(self, "fused_experts", None)  # the runner's (runner/linear/experts.py)
        if fused is not None and routing is None and not torch.is_grad_enabled():
            return fused(self, x)
        weights, chosen = self.route(x) if routing is None else routing
        slots = chosen.flatten()
        order = torch.argsort(slots, stable=True)  # token slots grouped by expert
        counts = torch.bincount(slots, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        slot_weights = weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            stop = start + count
            if count and expert in self.held:
                rows = tokens[start:stop]
                y = self.experts[str(expert)](x[rows])
                out.index_add_(0, rows, y * slot_weights[start:stop])
            start = stop
        self.expert_load = counts
        return out
