"""Every architecture against transformers on the same random weights: one flat
batch, chunked prefill and token-by-token decode through the paged cache (and a
hybrid's state cache, one slot a sequence)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models.loader import load_model
from tandem.runner.model_runner import ModelRunner, SequenceChunk, forward_no_cache
from tandem.runner.static_batch import generate_recompute, generate_with_cache
from tests.hf_models import ARCHITECTURES, VOCAB_SIZE, assert_close, reference_logits

ROPE_VARIANTS = {
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "yarn": dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "tied": dict(tie_word_embeddings=True),
}
CASES = [(arch, {}) for arch in ARCHITECTURES] + [("llama", v) for v in ROPE_VARIANTS.values()]
CASE_IDS = list(ARCHITECTURES) + [f"llama-{name}" for name in ROPE_VARIANTS]
PROMPT_LENS = [37, 5, 1, 64, 19]


def prompts(lengths=PROMPT_LENS, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]


def contiguous_tables(lengths, block_size, shuffle_seed=0):
    """Non-overlapping block tables, blocks deliberately scattered over the pool."""
    counts = [-(-n // block_size) for n in lengths]
    pool = list(range(sum(counts) + 3))
    random.Random(shuffle_seed).shuffle(pool)
    tables, start = [], 0
    for count in counts:
        tables.append(pool[start : start + count])
        start += count
    return tables, len(pool)


@pytest.mark.parametrize(("arch", "overrides"), CASES, ids=CASE_IDS)
def test_flat_batch_matches_transformers(model_dirs, arch, overrides):
    folder, hf_model = model_dirs(arch, **overrides)
    loaded = load_model(folder)
    batch = prompts()
    tables, num_blocks = contiguous_tables([len(p) for p in batch], 16)
    runner = ModelRunner(loaded, num_blocks, 16, num_state_slots=len(batch))
    chunks = [
        SequenceChunk(p, 0, t, state_slot=i)
        for i, (p, t) in enumerate(zip(batch, tables, strict=True))
    ]
    logits = runner.forward(chunks, all_logits=True)
    start = 0
    for ids in batch:
        assert_close(logits[start : start + len(ids)], reference_logits(hf_model, ids))
        start += len(ids)
    # The no-cache path agrees too.
    ids = batch[0]
    assert_close(forward_no_cache(loaded, torch.tensor([ids]))[0], reference_logits(hf_model, ids))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_whole_chunked_and_token_by_token_agree(model_dirs, arch, block_size):
    """Prompt whole vs in chunks of several sizes vs one token at a time, with the
    sequences at different stages sharing each forward."""
    folder, hf_model = model_dirs(arch)
    loaded = load_model(folder)
    batch = prompts([45, 30, 12], seed=2)
    references = [reference_logits(hf_model, ids) for ids in batch]
    tables, num_blocks = contiguous_tables([len(p) for p in batch], block_size)
    for chunk_sizes in ([100], [8, 3, 13], [1]):
        runner = ModelRunner(loaded, num_blocks, block_size, num_state_slots=len(batch))
        done = [0] * len(batch)
        collected = [[] for _ in batch]
        step = 0
        while any(d < len(p) for d, p in zip(done, batch, strict=False)):
            chunks, owners = [], []
            for i, ids in enumerate(batch):
                # Each sequence takes a different chunk size in the same step.
                size = chunk_sizes[(step + i) % len(chunk_sizes)]
                if done[i] < len(ids):
                    chunk = ids[done[i] : done[i] + size]
                    chunks.append(SequenceChunk(chunk, done[i], tables[i], state_slot=i))
                    owners.append(i)
            logits = runner.forward(chunks, all_logits=True)
            start = 0
            for chunk, i in zip(chunks, owners, strict=False):
                collected[i].append(logits[start : start + len(chunk.token_ids)])
                start += len(chunk.token_ids)
                done[i] += len(chunk.token_ids)
            step += 1
        for got, ref in zip(collected, references, strict=False):
            assert_close(torch.cat(got), ref)


def test_sharded_checkpoint_loads(model_dirs):
    folder, hf_model = model_dirs("llama", hidden_size=128, intermediate_size=256)
    sharded_folder = folder.parent / "llama-sharded"
    hf_model.save_pretrained(sharded_folder, max_shard_size="100KB")
    assert (sharded_folder / "model.safetensors.index.json").is_file()
    loaded = load_model(sharded_folder, load_tokenizer=False)
    ids = prompts([23])[0]
    ours = forward_no_cache(loaded, torch.tensor([ids]))[0]
    assert_close(ours, reference_logits(hf_model, ids))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3", "qwen3_5", "lfm2"])
def test_greedy_generation_matches_transformers(model_dirs, arch):
    folder, hf_model = model_dirs(arch)
    loaded = load_model(folder)
    batch = prompts([9, 9, 9], seed=3)
    new_tokens = 12
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor(batch),
            attention_mask=torch.ones(3, 9, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[:, 9:]
    assert (
        generate_with_cache(loaded, batch, new_tokens, block_size=4).tolist() == expected.tolist()
    )
    naive = generate_recompute(loaded, torch.tensor(batch), new_tokens)
    assert naive.tolist() == expected.tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bfloat16_close_to_transformers_bfloat16(model_dirs, arch):
    folder, hf_model = model_dirs(arch)
    loaded = load_model(folder, dtype="bfloat16")
    ids = prompts([40])[0]
    hf_bf16 = type(hf_model)(hf_model.config).eval()
    hf_bf16.load_state_dict(hf_model.state_dict())
    hf_bf16 = hf_bf16.to(torch.bfloat16)
    runner = ModelRunner(loaded, 8, 16)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2])], all_logits=True)
    assert_close(ours, reference_logits(hf_bf16, ids), rel=3e-2)


def test_gemma3_configs_of_both_transformers_generations_parse_alike():
    """transformers 4 wrote rope_theta / rope_local_base_freq / rope_scaling and a
    sliding_window_pattern; transformers 5 writes rope_parameters per layer kind and
    layer_types. Both describe the same model."""
    from tandem.models.gemma3 import parse_gemma3_config

    common = dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=384, hidden_size=64,
        intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
    )  # fmt: skip
    old = parse_gemma3_config(
        dict(common, rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
    )  # fmt: skip
    new = parse_gemma3_config(
        dict(
            common,
            layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    )
    assert old == new
    assert new.layer_windows() == (8, 8, 8, 8, 8, None, 8)
    assert (new.rope.theta, new.rope.scaling_type) == (1e6, "linear")
    assert new.family_options["local_rope"].theta == 10000.0
