"""`tandem plan`: the formulas against hand-worked cases from the literature, the
parameter count against transformers, and the command as users run it."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest
import torch
import transformers

from tandem import cli
from tandem.errors import InvalidParameterError
from tandem.models.gguf_file import GGUFFile
from tandem.plan.calculator import (
    attended_pairs,
    attention_flops,
    decode_step_seconds,
    engine_kv_dtype,
    format_plan,
    kv_bytes_per_token,
    plan,
    prefill_seconds,
    read_model,
)
from tandem.plan.cost import StepCostModel
from tandem.plan.hardware import PRESETS, Hardware, custom_hardware
from tandem.runner.attention.metadata import sliding_causal_mask

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}  # fmt: skip


def test_kv_bytes_per_token_hand_worked():
    # Llama-70B-style: 80 layers, 8 KV heads of 128, fp16: 320 KiB per token.
    assert kv_bytes_per_token(80, 8, 128, 2) == 327_680
    # Llama-2-13B-style (no GQA): 40 layers, 40 KV heads of 128: about 0.8 MB.
    assert kv_bytes_per_token(40, 40, 128, 2) == pytest.approx(0.8e6, rel=0.03)
    # Tensor parallelism splits KV heads; beyond 8 ranks each holds one (replicated).
    assert kv_bytes_per_token(80, 8, 128, 2, tp=4) == 327_680 / 4
    assert kv_bytes_per_token(80, 8, 128, 2, tp=16) == 327_680 / 8


def test_time_floors_hand_worked():
    assert prefill_seconds(7e9, 1024, 312) == pytest.approx(0.046, rel=0.01)
    assert decode_step_seconds(14e9, 1, 0, 0, 2000) == pytest.approx(0.007)
    assert decode_step_seconds(140e9, 1, 0, 0, 3400) == pytest.approx(0.041, rel=0.01)
    # KV reads add batch x context x bytes per token...
    assert decode_step_seconds(14e9, 8, 1000, 500_000, 2000) == pytest.approx(0.009)
    # ...at the rate the decode attention kernel reads them, where it is known.
    assert decode_step_seconds(14e9, 8, 1000, 500_000, 2000, 1000) == pytest.approx(0.011)


def test_attention_is_priced_by_the_pairs_the_engines_mask_lets_through(tmp_path):
    for length, window in ((1, None), (7, None), (64, None), (64, 16), (64, 64), (64, 99),
                           (5, 1)):  # fmt: skip
        mask = sliding_causal_mask(length, window, torch.device("cpu"))
        if mask is None:
            mask = torch.ones(length, length, dtype=torch.bool).tril()
        assert attended_pairs(length, window) == mask.sum().item()
    path = tmp_path / "llama70b.json"
    path.write_text(json.dumps(LLAMA_70B))
    config, _ = read_model(path)
    # 80 layers x 64 heads x 128 dims x 4 FLOPs x 1024 x 1025 / 2 pairs: 1.38 TFLOP.
    assert attention_flops(config, 1024) == 80 * 64 * 128 * 4 * 524_800
    # On an H100 that is 1.4 ms beside the matmuls' 146 ms, in bf16's rate.
    result = plan(path, PRESETS["h100-sxm"], "q4_0", None, 1024, 1)
    assert result["prefill_attention_s"] == pytest.approx(1.376e12 / 989e12, rel=1e-3)
    assert result["prefill_floor_s"] == pytest.approx(
        prefill_seconds(result["parameters"], 1024, 989) + result["prefill_attention_s"]
    )
    # A measured rate (a CPU's float attention beside its integer matmuls) is used as is.
    slow = Hardware("slow", 80, 3350, {"bf16": 989}, "", 0.1)
    slow_attention = plan(path, slow, "bf16", None, 1024, 1)["prefill_attention_s"]
    assert slow_attention == pytest.approx(13.76, rel=1e-3)


def test_this_machine_measures_its_attention_kernels(model_dirs):
    """--hardware cpu: a prompt's attention and decode's K/V reads at the rates the
    engine's kernels reach here, and the plan's floors priced with them."""
    from tandem.kernels import cpu as cpu_kernels
    from tandem.plan.measure import this_machine

    folder, _ = model_dirs("llama")
    config, _ = read_model(folder)
    hardware = this_machine("fp32", None, config, 64)
    assert 0 < hardware.attention_tflops < hardware.flops_for("fp32") * 10
    if cpu_kernels.load() is None:
        assert hardware.kv_bandwidth_gbs is None
        return
    assert hardware.kv_bandwidth_gbs > 0
    result = plan(folder, hardware, "fp32", None, 64, 64, batch=4, engine_cpu=True)
    kv = 4 * (64 + 32) * result["kv_bytes_per_token"]
    assert result["decode_step_floor_s"] == pytest.approx(
        result["weight_bytes_read_per_step"] / (hardware.bandwidth_gbs * 1e9)
        + kv / (hardware.kv_bandwidth_gbs * 1e9)
    )


def test_parameter_count_matches_transformers_from_config_alone(tmp_path):
    small = {**LLAMA_70B, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 3, "num_attention_heads": 8, "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(small))
    _, params = read_model(tmp_path)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    assert params == sum(p.numel() for p in hf.parameters())


def test_a_70b_plan_on_h100s(tmp_path):
    path = tmp_path / "llama70b.json"
    path.write_text(json.dumps(LLAMA_70B))
    result = plan(path, PRESETS["h100-sxm"], "bf16", None, 2048, 512, batch=32, tp=4)
    assert result["parameters"] == pytest.approx(70.55e9, rel=1e-3)
    assert result["kv_bytes_per_token"] == 327_680
    assert result["weights_fit"] and result["batch_fits"]
    per_rank_budget = 80e9 * 0.9 - result["weight_bytes"] / 4
    assert result["max_kv_tokens"] == int(per_rank_budget // (327_680 / 4))
    # One H100 cannot hold 141 GB of bf16 weights.
    alone = plan(path, PRESETS["h100-sxm"], "bf16", None, 2048, 512, batch=1, tp=1)
    assert not alone["weights_fit"] and alone["max_kv_tokens"] == 0
    # bf16 weights: decode turns compute-bound (weights only) near FLOP/s / bandwidth.
    ratio = 989e12 / 3350e9
    assert alone["crossover_batch_weights_only"] == pytest.approx(ratio, rel=1e-6)
    assert alone["tpot_estimate_s"] >= alone["weight_bytes"] / 3350e9


def test_the_plan_prices_the_collectives_and_says_when_tensor_parallelism_pays(tmp_path):
    path = tmp_path / "llama70b.json"
    path.write_text(json.dumps(LLAMA_70B))
    nvlink = plan(path, PRESETS["h100-sxm"], "bf16", None, 2048, 512, batch=32, tp=4)
    # 80 layers x 2 all-reduces of 32 x 8,192 bf16 values over NVLink's 450 GB/s, each
    # 20 us + 1.5 x 512 kB / 450 GB/s; then 32 rows of logits gathered.
    per_allreduce = 20e-6 + 1.5 * 32 * 8192 * 2 / 450e9
    gather = 20e-6 + 0.75 * 32 * 128256 * 4 / 450e9
    assert nvlink["decode_collectives_s"] == pytest.approx(160 * per_allreduce + gather)
    assert nvlink["tpot_estimate_s"] == pytest.approx(
        max(nvlink["decode_step_floor_s"], nvlink["decode_step_compute_s"])
        + nvlink["decode_collectives_s"]
    )
    one = nvlink["one_device"]
    assert one["tpot_estimate_s"] / nvlink["tpot_estimate_s"] > 3  # 4 devices' bandwidth
    # Over a link a millisecond away, the collectives cost more than the split gains.
    slow = plan(path, PRESETS["h100-sxm"], "bf16", None, 2048, 512, batch=32, tp=4,
                link=(450, 1e-3))  # fmt: skip
    assert slow["one_device"]["tpot_estimate_s"] < slow["tpot_estimate_s"]
    assert "TP 4 against 1" in format_plan(slow)
    assert "one_device" not in plan(path, PRESETS["h100-sxm"], "bf16", None, 2048, 512)


def test_quantized_weights_take_their_block_formats_bytes(tmp_path):
    """llama.cpp's formats: Q8_0 8.5 bits a weight, Q4_0 4.5, Q4_1 5, Q4_K 4.5, Q6_K
    6.5625 (scales included), and every other type it writes at its block's size (as
    gguf-py gives it: Q2_K 2.625, IQ2_XXS 2.0625, ...); the KV cache keeps its own dtype."""
    path = tmp_path / "llama70b.json"
    path.write_text(json.dumps(LLAMA_70B))
    bf16 = plan(path, PRESETS["h100-sxm"], "bf16", None, 2048, 512)
    for dtype, bits in (("q8_0", 8.5), ("q4_0", 4.5), ("q4_1", 5), ("q4_k", 4.5),
                        ("q6_k", 6.5625), ("q3_k", 3.4375), ("q2_k", 2.625), ("iq4_xs", 4.25),
                        ("iq4_nl", 4.5), ("mxfp4", 4.25), ("iq2_xxs", 2.0625), ("iq1_s", 1.5625),
                        ("tq1_0", 1.6875)):  # fmt: skip
        result = plan(path, PRESETS["h100-sxm"], dtype, "bf16", 2048, 512)
        assert result["weight_bytes"] == pytest.approx(bf16["weight_bytes"] * bits / 16)
        assert result["kv_bytes_per_token"] == bf16["kv_bytes_per_token"]
        # unless told, the cache is what the engine keeps: never the weights' format
        assert plan(path, PRESETS["h100-sxm"], dtype)["kv_dtype"] == "bf16"


def test_the_kv_dtype_is_the_engines_cache_not_the_weights_format():
    assert engine_kv_dtype("q4_0", on_cpu=True) == "fp32"  # computed in float32 there
    assert engine_kv_dtype("q4_k", on_cpu=False) == "bf16"
    assert engine_kv_dtype("bfloat16", on_cpu=True) == "bf16"  # float weights: their type
    assert engine_kv_dtype("fp32", on_cpu=False) == "fp32"


def test_bad_values_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    with pytest.raises(InvalidParameterError, match="dtype"):
        plan(tmp_path, PRESETS["l4"], "fp4")
    with pytest.raises(InvalidParameterError, match="batch"):
        plan(tmp_path, PRESETS["l4"], batch=0)
    with pytest.raises(InvalidParameterError, match="--bandwidth"):
        custom_hardware(80, None, 100)


def test_this_machine_refuses_what_its_engine_cannot_run_before_measuring(model_dirs):
    """--hardware cpu checks its arguments first: a cache type the CPU engine has no
    cache for (fp16 was a KeyError traceback) and a bad length are named, exit 2."""
    folder, _ = model_dirs("llama")
    fp16 = run_plan("--model", str(folder), "--hardware", "cpu", "--kv-dtype", "fp16")
    assert fp16.returncode == 2 and "kv_dtype" in fp16.stderr and "Traceback" not in fp16.stderr
    short = run_plan("--model", str(folder), "--hardware", "cpu", "--prompt-len", "0")
    assert short.returncode == 2 and "prompt_len" in short.stderr


def run_plan(*args):
    """`tandem plan ARGS` through the CLI's own entry point, in this process: the
    same parsing, output and exit status as the command, without paying a fresh
    interpreter's imports (about 5 s) each call. One test below runs the real
    `python -m tandem plan`."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            returncode = cli.main(["plan", *args])
        except SystemExit as exit_:  # argparse's usage errors
            returncode = exit_.code
    return subprocess.CompletedProcess(args, returncode, stdout.getvalue(), stderr.getvalue())


def run_plan_command(*args):
    return subprocess.run(
        [sys.executable, "-m", "tandem", "plan", *args], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_the_command_prints_and_answers_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    text = run_plan_command("--model", str(tmp_path), "--hardware", "h200", "--tp", "2")
    assert text.returncode == 0, text.stderr
    assert "KV per token       327,680 bytes" in text.stdout and "TPOT estimate" in text.stdout
    as_json = run_plan(
        "--model", str(tmp_path), "--hardware", "custom", "--bandwidth", "1000",
        "--flops", "100", "--memory", "200", "--json",
    )  # fmt: skip
    result = json.loads(as_json.stdout)
    assert result["kv_bytes_per_token"] == 327_680 and result["bandwidth_gbs"] == 1000
    missing = run_plan("--model", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "neither a model folder" in missing.stderr


def test_measure_puts_achieved_beside_the_floor(model_dirs):
    folder, _ = model_dirs("llama")
    result = run_plan("--model", str(folder), "--measure", "--prompt-len", "64", "--batch", "4",
                      "--dtype", "fp32", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)
    measured = planned["measured"]
    assert planned["hardware"].startswith("this machine")  # measured bandwidth and FLOP/s
    assert measured["prefill_of_floor"] == pytest.approx(
        planned["prefill_floor_s"] / measured["prefill_s"]
    )
    # (How near the floor a run comes is a timing: docs/lab-notes/planning.md's `tandem plan
    # --measure` section records it; beside other test workers it read up to 2.6x.)


def test_a_slow_machine_reads_with_its_digits(tmp_path):
    """An AVX2-only CPU's bf16 matmuls run at about 1 GFLOP/s: the plan says so (not
    "0.0 TFLOP/s"), and a decode step compute-bound from the first sequence says
    batch 1, not batch 0."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    slow = run_plan(
        "--model", str(tmp_path), "--hardware", "custom", "--bandwidth", "20",
        "--flops", "0.0009", "--memory", "1000",
    )  # fmt: skip
    assert slow.returncode == 0, slow.stderr
    assert "0.9 GFLOP/s (bf16)" in slow.stdout
    assert "compute-bound at   batch 1 (compute-bound at every batch)" in slow.stdout


def test_this_machine_is_planned_in_the_engines_dtype(model_dirs, tmp_path):
    folder, _ = model_dirs("llama")
    planned = json.loads(run_plan("--model", str(folder), "--hardware", "cpu", "--json").stdout)
    assert planned["dtype"] == "fp32"  # what the CPU engine runs, not bf16
    quantized = run_plan("--model", str(folder), "--hardware", "cpu", "--dtype", "q4_0", "--json")
    assert json.loads(quantized.stdout)["kv_dtype"] == "fp32"  # the engine's cache, not q4_0
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    refused = run_plan("--model", str(tmp_path), "--measure")
    assert refused.returncode == 2 and "too many to run here" in refused.stderr
    assert "measured" not in refused.stdout  # refused before measuring anything


def test_calibrate_fits_the_cost_model_to_real_steps(model_dirs, tmp_path):
    folder, _ = model_dirs("llama")
    saved = tmp_path / "cost.json"
    result = run_plan("--model", str(folder), "--measure", "--calibrate", str(saved), "--json")
    assert result.returncode == 0, result.stderr
    calibrated = json.loads(result.stdout)["calibrated"]
    model = StepCostModel.load(saved)
    assert calibrated["steps"] >= 20 and model.source.startswith("fitted to")
    assert model.step_overhead_s + model.request_overhead_s > 0  # a CPU step is never free
    # (How well the fit predicts is a timing: docs/BENCHMARKS.md records it; measured
    # beside another test worker's load it read 3.7; a fit that failed reads NaN.)
    assert math.isfinite(calibrated["median_error"])
    without = run_plan("--model", str(folder), "--calibrate", str(saved))
    assert without.returncode == 2 and "needs --measure" in without.stderr


def test_calibration_fits_the_sweep_and_not_its_warm_up(model_dirs):
    """The sweep's samples: one step per prompt length that fits the context, and the
    last DECODE_STEPS of each decode setting; the warm-up's steps (page faults, first
    calls) are not among them."""
    from tandem.plan import calibrate as sweep
    from tandem.plan.cost import ModelShape

    folder, _ = model_dirs("llama")
    config, params = read_model(folder)
    shape = ModelShape.of(config, params, 4, 4)
    context = 300
    _, samples = sweep.calibrate(folder, shape, "float32", context)
    prefills = sum(length < context for length in sweep.PREFILL_LENGTHS)
    settings = sum(
        cached + sweep.DECODE_STEPS + 1 <= context
        for cached in sweep.DECODE_CONTEXTS for _ in sweep.DECODE_BATCHES
    )  # fmt: skip
    assert len(samples) == prefills + settings * sweep.DECODE_STEPS


def test_a_gguf_file_is_priced_as_the_engine_holds_it(tmp_path):
    """A GGUF file planned for this machine: its weights at the bytes the engine holds
    them in (each tensor's packed layout: Q4_K takes a little more than in the file),
    a decode step reading all but the embedding, and the KV capacity the engine
    allocates by default, block for block."""
    from tandem import LLM
    from tandem.models.quantized import packed_parts
    from tandem.models.random_gguf import Shape, write_random_gguf

    shape = Shape(256, 2, 4, 2, 512, tied=False, vocab=1024, context=4096)
    path = write_random_gguf(tmp_path / "mix.gguf", shape, "q4_k_m")
    hardware = custom_hardware(16, 20, 1.0)
    planned = plan(path, hardware, "gguf", engine_cpu=True)
    assert planned["dtype"] == "gguf" and planned["weight_formats"] == "Q4_K"
    assert planned["kv_dtype"] == "fp32"
    llm = LLM(str(path), max_num_seqs=4)  # the engine's capacity does not depend on it...
    model = llm.engine.executor.runner.model
    packed = {id(w): w.nbytes for m in model.modules() for _, w in packed_parts(m)}
    packed[id(model.model.embed_tokens.packed)] = model.model.embed_tokens.packed.nbytes
    held = sum(packed.values()) + sum(p.nbytes for p in model.parameters())
    assert planned["weight_bytes"] == held
    embedding = model.model.embed_tokens.packed.nbytes
    assert planned["weight_bytes_read_per_step"] == held - embedding
    # ...when the default budget, not max_num_seqs x context, bounds it; this file's
    # 4,096-token context times the default 128 sequences needs all of the budget.
    default = LLM(str(path))
    info = default.engine.executor.info
    assert planned["max_kv_tokens"] == info.num_blocks * info.block_size
    config = tmp_path / "llama70b.json"
    config.write_text(json.dumps(LLAMA_70B))
    with pytest.raises(InvalidParameterError, match="needs a GGUF"):
        plan(config, hardware, "gguf")


def test_a_step_overhead_is_the_measured_batchs_or_the_line_between_two():
    hardware = Hardware("m", 16, 20, {"fp32": 1.0}, step_overheads={1: 0.002, 16: 0.011})
    assert hardware.step_overhead(1) == 0.002 and hardware.step_overhead(16) == 0.011
    assert hardware.step_overhead(4) == pytest.approx(0.002 + 0.009 * 3 / 15)
    assert hardware.step_overhead(64) == pytest.approx(0.002 + 0.009 * 63 / 15)  # the line
    assert Hardware("m", 16, 20, {"fp32": 1.0}, step_overheads={1: 0.002}).step_overhead(8) == 0.002
    assert custom_hardware(16, 20, 1.0).step_overhead(8) == 0.0  # a floor: none


def test_the_estimates_add_the_engines_fixed_cost_and_the_floors_do_not(tmp_path):
    """The overhead measured for a step is added to TPOT (at the batch) and to TTFT (a
    prompt's step: batch 1's); the floors stay floors."""
    from tandem.models.random_gguf import Shape, write_random_gguf

    path = write_random_gguf(tmp_path / "f.gguf", Shape(256, 2, 4, 2, 512, False, 1024), "q4_0")
    bare = custom_hardware(16, 20, 1.0)
    timed = Hardware(bare.name, 16, 20, bare.tflops, step_overheads={1: 0.002, 8: 0.009})
    a, b = (plan(path, h, "gguf", batch=4) for h in (bare, timed))
    assert b["tpot_estimate_s"] - a["tpot_estimate_s"] == pytest.approx(0.002 + 0.007 * 3 / 7)
    assert b["ttft_estimate_s"] - a["ttft_estimate_s"] == pytest.approx(0.002)
    assert b["decode_step_floor_s"] == a["decode_step_floor_s"]
    assert b["prefill_floor_s"] == a["prefill_floor_s"]
    assert "engine fixed cost" in format_plan(b) and "engine fixed cost" not in format_plan(a)


def test_the_engines_fixed_cost_is_timed_on_a_tiny_twin_of_the_file(tmp_path, monkeypatch):
    """The twin keeps what sets the fixed cost (architecture, layers, head dimension,
    attention grouping, vocabulary, experts) and is TINY_WIDTH wide; the engine runs it
    and a step's cost beyond its weights is positive at each batch asked. A head
    dimension the width cannot hold has no twin: nothing is measured. A batch beyond
    MAX_BATCH is measured at MAX_BATCH (the plan extends the line beyond it)."""
    from tandem.models.random_gguf import Shape, write_random_gguf
    from tandem.plan import fixed_cost
    from tandem.plan.fixed_cost import TINY_WIDTH, step_overheads, tiny_shape

    shape = Shape(1024, 3, 16, 4, 2048, tied=True, vocab=3000, head_size=64)
    path = write_random_gguf(tmp_path / "dense.gguf", shape, "q8_0")
    twin, fmt = tiny_shape(path)
    assert fmt == "q8_0" and twin.hidden == TINY_WIDTH and twin.layers == 3
    assert (twin.head_dim, twin.heads, twin.kv_heads, twin.vocab) == (64, 4, 1, 3000)
    measured = step_overheads(path, [1, 4], 32, bandwidth_gbs=20.0, tflops=0.5)
    assert set(measured) == {1, 4} and all(0 < s < 1 for s in measured.values())
    moe = Shape(512, 2, 8, 2, 0, tied=False, vocab=1000, head_size=64,
                architecture="qwen3moe", experts=16, experts_used=4,
                expert_intermediate=128)  # fmt: skip
    twin, fmt = tiny_shape(write_random_gguf(tmp_path / "moe.gguf", moe, "q4_0"))
    assert (twin.experts, twin.experts_used, twin.architecture, fmt) == (16, 4, "qwen3moe", "q4_0")
    monkeypatch.setattr(fixed_cost, "MAX_BATCH", 3)  # a user's batch: the twin runs at most
    assert set(step_overheads(path, [1, 100], 32, 20.0, 0.5)) == {1, 3}
    odd = Shape(480, 2, 5, 1, 512, tied=True, vocab=1000, head_size=96)
    path = write_random_gguf(tmp_path / "odd.gguf", odd, "q8_0")
    assert tiny_shape(path) is None and step_overheads(path, [1], 16, 20.0, 0.5) is None


# A Qwen3-MoE config.json small enough to build: 3 layers of 16 experts, 4 a token.
SMALL_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip


def test_a_mixture_of_experts_is_priced_by_the_experts_a_step_reads(tmp_path):
    """Qwen3-MoE: the parameter count is transformers'; a token's active parameters
    are every weight but the experts it did not pick (counted on transformers' model);
    the distinct experts a batch reads match uniform routing drawn at random; a decode
    step's weight reads grow with the batch and stop at the whole file."""
    import random

    from tandem.models.random_gguf import Shape, write_random_gguf
    from tandem.plan.cost import expected_experts

    raw = SMALL_QWEN3_MOE
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**raw))
    hardware = custom_hardware(16, 20, 1.0)
    planned = plan(tmp_path, hardware, "bf16", batch=1)
    assert planned["parameters"] == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    assert planned["active_parameters"] == pytest.approx(
        planned["parameters"] - experts * (1 - 4 / 16)
    )
    rng = random.Random(0)
    for tokens in (1, 3, 10, 40):
        drawn = [len({e for _ in range(tokens) for e in rng.sample(range(16), 4)})
                 for _ in range(4000)]  # fmt: skip
        assert expected_experts(16, 4, tokens) == pytest.approx(sum(drawn) / 4000, rel=0.02)
    # The file: reads at batch 1 are all but 12 of 16 experts' bytes; at 64 all of them.
    shape = Shape(256, 3, 4, 2, 512, tied=False, vocab=1024, context=4096, head_size=64,
                  architecture="qwen3moe", experts=16, experts_used=4,
                  expert_intermediate=256)  # fmt: skip
    path = write_random_gguf(tmp_path / "moe.gguf", shape, "q4_0")
    one, many = (plan(path, hardware, "gguf", batch=b) for b in (1, 64))
    stacks = sum(t.nbytes for t in GGUFFile(path).tensors if "_exps" in t.name)
    assert one["weight_bytes_read_per_step"] == pytest.approx(
        many["weight_bytes_read_per_step"] - stacks * (1 - 4 / 16), rel=0.01
    )
    assert many["experts_read_per_step"] == pytest.approx(16, rel=0.001)
    assert "active a token: 4 of 16 experts a layer" in format_plan(one)
    assert one["crossover_batch"] == many["crossover_batch"]  # (not the planned batch's)


def test_expert_parallel_ranks_are_priced_by_the_busiest_one(tmp_path):
    """Each of N ranks holds a run of the experts (models/sharding.py's split where an
    expert's columns do not cut evenly): the distinct experts the busiest rank reads a
    layer, by brute force over every way a token picks (exact), and by drawing batches
    at random; one rank is expected_experts; and under --tp 3 (128 columns do not cut
    in 3) the plan reads as if every rank read as much as the busiest (the others wait
    for it at the all-reduce), so the decode reads more than an even split of one
    device's. Under --tp 2 the ranks split every expert's 128 columns (the engine's
    default): each reads its half of the same picks, as one device reads them."""
    import itertools
    import random

    from tandem.models.sharding import split_evenly
    from tandem.plan.cost import busiest_rank_experts, expected_experts

    def exact(experts, k, ranks):  # one token: every k-subset equally likely
        owner = {e: r for r in range(ranks) for e in split_evenly(experts, ranks, r)}
        picks = list(itertools.combinations(range(experts), k))
        return sum(max(sum(owner[e] == r for e in p) for r in range(ranks)) for p in picks) / len(
            picks
        )

    for experts, k, ranks in ((4, 2, 2), (8, 2, 2), (10, 3, 3), (16, 4, 4)):
        assert busiest_rank_experts(experts, k, 1, ranks) == pytest.approx(
            exact(experts, k, ranks), rel=0.02
        )
    rng, experts, k = random.Random(0), 16, 4
    for tokens in (3, 10):
        owner = {e: r for r in range(2) for e in split_evenly(experts, 2, r)}
        drawn = []
        for _ in range(4000):
            read = {e for _ in range(tokens) for e in rng.sample(range(experts), k)}
            drawn.append(max(sum(owner[e] == r for e in read) for r in range(2)))
        assert busiest_rank_experts(experts, k, tokens, 2) == pytest.approx(
            sum(drawn) / 4000, rel=0.02
        )
    assert busiest_rank_experts(16, 4, 5, 1) == expected_experts(16, 4, 5)
    assert busiest_rank_experts(16, 4, 500, 4) == 4  # every expert, on every rank

    raw = SMALL_QWEN3_MOE
    hardware = custom_hardware(16, 20, 1.0)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    one, two, three = (plan(tmp_path, hardware, "bf16", batch=1, tp=tp) for tp in (1, 2, 3))
    assert two["experts_split"] and not three["experts_split"]
    assert two["experts_read_busiest_rank"] == pytest.approx(4)  # a token's 4 picks
    assert two["weight_bytes_read_per_step"] == one["weight_bytes_read_per_step"]
    assert "all 16, 1/2 of each one's columns" in format_plan(two)
    busiest = busiest_rank_experts(16, 4, 1, 3)
    assert 4 / 3 < busiest < 4 and three["experts_read_busiest_rank"] == busiest
    expert_bytes = 3 * 16 * (3 * 256 * 128) * 2  # layers x experts x (gate, up, down), bf16
    extra = expert_bytes * (busiest * 3 - 4) / 16  # the busiest rank's, times 3 ranks
    assert three["weight_bytes_read_per_step"] == pytest.approx(
        one["weight_bytes_read_per_step"] + extra, rel=1e-6
    )
    assert f"busiest rank reads {busiest:.1f} a layer" in format_plan(three)
