"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert)
through the whole engine, against
transformers on the same random weights; the experts that run are the ones picked."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.loader import load_model
from tandem.models.moe import SparseMoE
from tests.hf_models import VOCAB_SIZE, reference_greedy

pytestmark = pytest.mark.usefixtures("two_threads")  # (conftest.py)

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
MAX_NEW = 8


def prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=16, block_size=5, num_blocks=24),  # chunks, preemption
        dict(enable_prefix_caching=True, block_size=4),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    ],
    ids=["preempted", "prefix-cached", "speculative"],
)
def test_greedy_tokens_equal_transformers(model_dirs, arch, options):
    folder, hf_model = model_dirs(arch)
    batch = prompts([23, 5, 31, 12, 17, 9], seed=3)
    if options.get("enable_prefix_caching"):  # a shared start, so that blocks are reused
        batch = [batch[0] + p for p in batch]
    llm = LLM(str(folder), **options)
    if options.get("enable_prefix_caching"):  # the shared start is computed once, first
        llm.generate([{"prompt_token_ids": batch[0]}], greedy(), use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy(hf_model, batch, MAX_NEW)
    if "num_blocks" in options:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    if options.get("enable_prefix_caching"):
        assert sum(o.num_cached_tokens for o in outputs) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_picked_experts_run_each_over_its_tokens(model_dirs, arch):
    """Every expert's forward is watched: the ones that run are exactly those the
    router picked for some token (brute force over the router's own probabilities),
    each once, over as many rows as tokens picked it."""
    folder, _ = model_dirs(arch)
    model = load_model(folder).model
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    ran: dict[int, list[int]] = {}
    for index, expert in layer.experts.items():
        expert.register_forward_hook(
            lambda _m, args, _out, i=int(index): ran.setdefault(i, []).append(args[0].shape[0])
        )
    x = torch.randn(5, model.config.hidden_size)
    layer(x)
    probs = torch.softmax(layer.gate(x), dim=-1)
    picked = [sorted(range(layer.num_experts), key=lambda e: -probs[t, e])[: layer.top_k]
              for t in range(5)]  # fmt: skip
    want = {e: sum(e in p for p in picked) for e in range(layer.num_experts)}
    assert {e: rows for e, rows in ran.items()} == {e: [n] for e, n in want.items() if n}
    assert layer.expert_load == [want[e] for e in range(layer.num_experts)]


def _rank_layers(path, size: int, expert_parallel: bool = False) -> list[list[SparseMoE]]:
    """Each rank's mixtures, loaded as that rank of ``size`` loads them (no group:
    each layer's output stays the rank's part of the sum)."""
    ranks = []
    for rank in range(size):
        llm_model = load_model(
            path, load_tokenizer=False, tensor_parallel=(rank, size),
            expert_parallel=expert_parallel,
        ).model  # fmt: skip
        ranks.append([m for m in llm_model.modules() if isinstance(m, SparseMoE)])
    return ranks


def _expert_width(layer: SparseMoE) -> int:
    """The intermediate columns of a layer's (first held) expert."""
    return layer.experts[str(layer.held.start)].down_proj.in_features


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["split-experts", "whole-experts"])
@pytest.mark.parametrize("arch", ARCHS)
def test_experts_split_across_ranks_add_up_to_the_whole_layer(model_dirs, arch, expert_parallel):
    """The tensor-parallel arithmetic of a mixture: by default each rank holds every
    expert's share of columns (gate/up rows, down columns); with expert parallelism a
    run of whole experts. Either way a rank holds its share of a shared expert's
    columns and routes over all experts; the ranks' outputs of a mixture add up to
    the whole layer's (float sums in another order), and its expert load is the whole
    router's on every rank."""
    folder, _ = model_dirs(arch)
    whole = [m for m in load_model(folder).model.modules() if isinstance(m, SparseMoE)]
    size = 2
    ranks = _rank_layers(folder, size, expert_parallel)
    x = torch.randn(9, whole[0].gate.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for index, layer in enumerate(whole):
            parts = [layers[index] for layers in ranks]
            held = [sorted(int(e) for e in part.experts) for part in parts]
            assert [list(p.held) for p in parts] == held
            if expert_parallel:
                assert [e for run in held for e in run] == list(range(layer.num_experts))
                assert all(_expert_width(p) == _expert_width(layer) for p in parts)
            else:
                assert all(run == list(range(layer.num_experts)) for run in held)
                assert sum(_expert_width(p) for p in parts) == _expert_width(layer)
                assert len({_expert_width(p) for p in parts}) == 1  # equal shares
            total = sum(part(x) for part in parts)
            torch.testing.assert_close(total, layer(x), rtol=1e-5, atol=1e-6)
            assert all(part.expert_load == layer.expert_load for part in parts)
            if layer.shared_expert is not None:
                widths = [p.shared_expert.down_proj.in_features for p in parts]
                assert sum(widths) == layer.shared_expert.down_proj.in_features


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["split-experts", "whole-experts"])
def test_a_quantized_files_experts_split_across_ranks_in_the_fused_kernel(
    tmp_path, expert_parallel
):
    """A Qwen3-MoE file's packed experts on 2 and 3 ranks, each rank's experts in the
    fused kernel; the ranks' outputs add up to one process's. Split experts (2 ranks:
    each expert's 256 columns are 4 blocks of 32 a rank): every rank reads its rows
    and columns of every expert, whole blocks of the file. Whole experts (expert
    parallelism, and 3 ranks, where 8 blocks do not split evenly): a rank runs only
    the experts it holds (the router's picks of others left out), and never reads
    another's experts from the file."""
    import re

    from tandem.models.random_gguf import Shape, write_random_gguf
    from tandem.models.weight_source import CheckpointTensor
    from tandem.runner.linear.experts import attach_fused_experts

    shape = Shape(256, 2, 4, 2, 512, tied=False, vocab=512, head_size=64,
                  architecture="qwen3moe", experts=8, experts_used=3,
                  expert_intermediate=256)  # fmt: skip
    path = write_random_gguf(tmp_path / "moe.gguf", shape, "q4_0")
    whole_model = load_model(path, load_tokenizer=False).model
    attach_fused_experts(whole_model)
    whole = [m for m in whole_model.modules() if isinstance(m, SparseMoE)]
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    read_experts: dict[int, list[tuple[int, ...]]] = {}
    read = CheckpointTensor.read

    def watched(self):
        found = re.search(r"\.experts\.(\d+)\.", self.name)
        if found:
            read_experts.setdefault(int(found.group(1)), []).append(self.shape)
        return read(self)

    for size in (2, 3):
        split = size == 2 and not expert_parallel
        ranks = []
        for rank in range(size):
            read_experts.clear()
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(CheckpointTensor, "read", watched)
                model = load_model(
                    path, load_tokenizer=False, tensor_parallel=(rank, size),
                    expert_parallel=expert_parallel,
                ).model  # fmt: skip
            assert attach_fused_experts(model) == len(whole)
            layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
            ranks.append(layers)
            held = set(layers[0].held)
            assert set(read_experts) == held
            assert {int(e) for e in layers[0].experts} == held
            if split:  # gate, up: 128 of 256 rows; down: 128 of 256 columns
                assert held == set(range(shape.experts))
                shapes = {s for each in read_experts.values() for s in each}
                assert shapes == {(128, 256), (256, 128)}
            else:
                assert len(held) < shape.experts
        with torch.inference_mode():
            for index, layer in enumerate(whole):
                total = sum(layers[index](x) for layers in ranks)
                torch.testing.assert_close(total, layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "arch, fmt",
    [("qwen3moe", f) for f in ("q4_0", "q4_k_m", "q8_0", "iq4_xs", "q2_k", "iq2_xxs")]
    + [("gpt-oss", "mxfp4"), ("gpt-oss", "q8_0")],
)
@pytest.mark.parametrize(
    "tokens, round_rows", [(1, 512), (3, 512), (40, 512), (600, 512), (600, 64)]
)
def test_the_fused_experts_kernel_equals_the_loop_over_experts(
    tmp_path, monkeypatch, arch, fmt, tokens, round_rows
):
    """A random Qwen3-MoE file's packed experts (or gpt-oss's: biases and the clamped
    SwiGLU): two kernel calls a layer (every picked expert's gate/up, then every one's
    down) give the per-expert loop's result bit for bit, for a token alone, a few
    sharing experts, many splitting over all, and a prompt chunk whose slots go in
    rounds (1,200 slots in rounds of 512, or of 64: experts then cut mid-way); the loop
    itself is the reference above (transformers)."""
    from tandem.models.random_gguf import Shape, write_random_gguf
    from tandem.runner.linear import experts

    monkeypatch.setattr(experts, "MLP_ROWS", round_rows)

    shape = Shape(256, 2, 4, 2, 512, tied=False, vocab=512, head_size=64,
                  architecture=arch, experts=8, experts_used=2,
                  expert_intermediate=256)  # fmt: skip
    path = write_random_gguf(tmp_path / "moe.gguf", shape, fmt)
    llm = LLM(str(path))
    layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, SparseMoE)]
    assert layers and all(hasattr(m, "fused_experts") for m in layers)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        for layer in layers:
            fused = layer(x)
            load = list(layer.expert_load)
            kernel = layer.__dict__.pop("fused_experts")
            try:
                assert torch.equal(fused, layer(x))
            finally:
                layer.fused_experts = kernel
            assert load == layer.expert_load and sum(load) == 2 * tokens


def test_a_mixtures_stack_call_takes_each_projections_power_of_two(tmp_path, monkeypatch):
    """An IQ2_XXS mixture (every output times d's 1/8, kernels/quant_ops.cpp's factor):
    decode steps of every layer in one call (the mixture's arguments converted in
    decode_stack.cpp) give the plain path's tokens and logprobs bit for bit."""
    from tandem.models.random_gguf import Shape, write_random_gguf

    shape = Shape(256, 2, 4, 2, 512, tied=False, vocab=512, head_size=64,
                  architecture="qwen3moe", experts=8, experts_used=2,
                  expert_intermediate=256)  # fmt: skip
    path = str(write_random_gguf(tmp_path / "moe.gguf", shape, "iq2_xxs"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9, 10, 11, 12, 13])]

    def run(flag: str):
        monkeypatch.setenv("TANDEM_FUSED_DECODE", flag)
        llm = LLM(path, max_num_seqs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        layers = llm.engine.executor.runner.model.model.layers
        stacked = bool(getattr(layers, "_fused_stack", None))
        return stacked, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    stacked, fused = run("1")
    assert stacked and run("0") == (False, fused)


def test_a_random_qwen2_moe_file_runs_its_experts_fused_beside_the_shared_one(tmp_path):
    """The random-file writer's Qwen2-MoE layout (stacked experts, a shared expert and
    its gate, q/k/v biases) loads; the routed experts take the fused kernel, the shared
    one runs beside them; a layout whose rows are not whole K-format blocks is refused."""
    from tandem.models.random_gguf import Shape, write_random_gguf

    shape = Shape(256, 2, 4, 4, 512, tied=False, vocab=512, architecture="qwen2moe",
                  experts=4, experts_used=2, expert_intermediate=96,
                  shared_intermediate=160)  # fmt: skip
    llm = LLM(str(write_random_gguf(tmp_path / "moe.gguf", shape, "q4_0")))
    layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == 2 and all(hasattr(m, "fused_experts") for m in layers)
    assert all(m.shared_expert is not None and not m.normalize for m in layers)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_NEW
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        write_random_gguf(tmp_path / "k.gguf", shape, "q4_k_m")


def test_the_trace_and_metrics_show_where_tokens_went(model_dirs):
    """Each step's expert load (tokens per expert of each sparse layer) reaches the
    observers: the trace's steps say how many experts a layer read and how unevenly,
    /metrics counts tokens per expert; a decode step of one token reads top_k a layer,
    and every token is routed top_k times in each sparse layer."""
    from tandem.serving.metrics import ServerMetrics
    from tandem.trace.recorder import StepTracer

    folder, _ = model_dirs("qwen3_moe")  # 3 layers, the middle one dense; 6 experts, 2 a token
    llm = LLM(str(folder))
    tracer, metrics = StepTracer(), ServerMetrics("moe")
    llm.engine.add_observer(tracer)
    llm.engine.add_observer(metrics)
    prompt = prompts([11], seed=4)[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)
    steps = list(tracer.steps)
    assert len(steps) == MAX_NEW  # the prompt's step, then a decode step a token
    assert all(s["experts_read"] == 2 and s["expert_imbalance"] == 1.0 for s in steps[1:])
    assert 2 <= steps[0]["experts_read"] <= 6 and steps[0]["expert_max_tokens"] <= 11
    routed = sum(
        sample.value
        for family in metrics.registry.collect()
        if family.name == "tandem:moe_expert_tokens"
        for sample in family.samples
        if sample.name.endswith("_total")
    )
    tokens = len(prompt) + MAX_NEW - 1  # (the last token is sampled, never run)
    assert routed == tokens * 2 * 2  # top 2, in each of the 2 sparse layers
    text = metrics.render().decode()
    assert 'tandem:moe_experts_read_per_layer_count{model_name="moe"} 8.0' in text
