"""The worker's start-up: load the model (this rank's shard), size and allocate the KV
pool, build the proposer, and hand back the runner that will run every step.

The executors (tandem/executor/) call ``build_runner`` once per rank; every rank of a
tensor-parallel group calls it together: a load that fails on any rank raises on all
of them, and all take the smallest pool any rank can hold.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tandem.config import EngineConfig, SpeculativeConfig
from tandem.errors import InvalidParameterError
from tandem.models.catalog import default_draft_model
from tandem.models.dtypes import torch_dtype_name
from tandem.models.loader import load_model
from tandem.models.registry import family_of
from tandem.runner.kv_cache import (
    cache_budget,
    host_available_bytes,
    kv_bytes_per_block,
    num_blocks_for,
)
from tandem.runner.model_runner import ModelRunner
from tandem.runner.proposing import Proposer
from tandem.runner.state_cache import split_budget
from tandem.runner.tensor_parallel import TensorParallel

logger = logging.getLogger("tandem.worker")


def build_runner(config: EngineConfig, tp: TensorParallel | None = None) -> ModelRunner:
    """One rank's runner with its speculative proposer (``tp``: this rank's view of
    its group; None in a single process)."""
    runner = load_runner(config, tp)
    runner.use_proposer(
        make_proposer(
            config.speculative, runner.loaded, runner.info.num_blocks, runner.block_size, tp
        )
    )
    return runner


def load_runner(config: EngineConfig, tp: TensorParallel | None = None) -> ModelRunner:
    """Load ``config.model`` (``tp``: this rank's shard) and size the KV pool from
    the memory settings into a ModelRunner (no proposer yet: ``build_runner``). Every
    rank of a group calls it together: a load that fails on any rank raises on all
    of them, and all take the smallest pool any rank can hold."""
    torch.manual_seed(config.seed)
    try:
        loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            quantization=config.quantization,
            tensor_parallel=None if tp is None else (tp.rank, tp.size),
            expert_parallel=config.parallel.enable_expert_parallel,
            hf_overrides=config.config_overrides(),
        )
        failure = None
    except Exception as exc:
        if tp is None:
            raise
        failure = exc
    if tp is not None:
        tp.raise_any(failure)
    family = family_of(loaded.config.architecture)
    if loaded.device.type == "cpu" and not family.fused_decode and not loaded.config.encoder:
        logger.info(
            "%s: decode steps run layer by layer (the family declares no fused-decode hook, "
            "runner/fused_decode.py)", family.name,
        )  # fmt: skip
    limit = loaded.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise InvalidParameterError(
            "max_model_len", f"{config.max_model_len} exceeds the model's context of {limit}"
        )
    max_model_len = config.max_model_len or limit
    cache = config.cache
    kv_cache_memory, num_slots = cache.kv_cache_memory, 0
    if loaded.config.recurrent_layers:  # a hybrid: state slots first, from the same budget
        budget = cache_budget(
            loaded.device, cache.kv_cache_memory, cache.gpu_memory_utilization,
            host_available_bytes() if loaded.device.type == "cpu" else None,
        )  # fmt: skip
        num_slots, kv_cache_memory = split_budget(
            loaded.config, int(budget), config.scheduler.max_num_seqs
        )
        if tp is not None:
            num_slots = tp.smallest(num_slots)
        logger.info(
            "state cache: %d sequences (%d recurrent layers, %.1f MiB a sequence, %.2f GiB)",
            num_slots, len(loaded.config.recurrent_layers),
            loaded.config.state_bytes_per_sequence() / (1 << 20),
            num_slots * loaded.config.state_bytes_per_sequence() / (1 << 30),
        )  # fmt: skip
        if config.speculative is not None and config.speculative.method == "layer_skip":
            raise InvalidParameterError(
                "speculative",
                f"{family.name}'s recurrent layers cannot be skipped by a draft (their "
                "states would miss its tokens): use ngram, suffix, eagle or a draft model",
            )
    num_blocks = num_blocks_for(
        loaded.config,
        cache.block_size,
        loaded.dtype,
        loaded.device,
        cache.num_blocks,
        kv_cache_memory,
        cache.gpu_memory_utilization,
        config.scheduler.max_num_seqs,
        max_model_len,
        cache.kv_cache_dtype,
    )
    if tp is not None:
        num_blocks = tp.smallest(num_blocks)
    per_block = kv_bytes_per_block(
        loaded.config, cache.block_size, loaded.dtype, cache.kv_cache_dtype
    )
    capacity = num_blocks * cache.block_size
    logger.info(
        "KV cache: %d tokens (%d blocks of %d, %.2f GiB, %s); context %d tokens",
        capacity, num_blocks, cache.block_size, num_blocks * per_block / (1 << 30),
        torch_dtype_name(loaded.dtype) if cache.kv_cache_dtype == "auto"
        else cache.kv_cache_dtype,
        max_model_len,
    )  # fmt: skip
    if capacity < max_model_len:
        logger.warning(
            "the KV cache holds %d tokens, fewer than the context of %d: longer requests "
            "are refused (raise kv_cache_memory or num_blocks, or lower max_model_len)",
            capacity, max_model_len,
        )  # fmt: skip
    runner = ModelRunner(
        loaded, num_blocks, cache.block_size, config.seed, None, cache.kv_cache_dtype, tp,
        0 if config.enforce_eager else config.scheduler.max_num_seqs, num_slots,
    )  # fmt: skip
    if tp is not None and tp.kv_file is not None:
        tp.smallest(0)  # every rank's cache file exists before rank 0 maps them
    runner.info = dataclasses.replace(runner.info, max_model_len=max_model_len)
    return runner


def make_proposer(
    spec: SpeculativeConfig | None, target, num_blocks: int, block_size: int, tp=None
) -> Proposer | None:
    """``tp``: the target is a tensor-parallel rank's shard (an EAGLE head borrows
    rows of its vocabulary from every rank)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        from tandem.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    if spec.method == "suffix":
        from tandem.spec_decode.suffix import SuffixProposer

        return SuffixProposer()
    if spec.method == "layer_skip":  # the target minus some layers, on its own runner
        from tandem.spec_decode.layer_skip import LayerSkipProposer

        return LayerSkipProposer(target, spec.skip_layers)

    def draft_runner(loaded):  # a draft's own paged cache, on the target's block ids
        if loaded.config.recurrent_layers:
            raise InvalidParameterError(
                "speculative", "a draft model with recurrent layers cannot roll its state "
                "back past rejected drafts: draft with an attention-only model"
            )  # fmt: skip
        return ModelRunner(loaded, num_blocks, block_size)

    if spec.method == "eagle":  # a trained head over the target's hidden states
        from tandem.spec_decode.eagle import EagleProposer

        return EagleProposer(spec.model, target, draft_runner, tp)
    from tandem.spec_decode.draft import DraftProposer

    return DraftProposer(spec.model or default_draft_model(), target, draft_runner)
