"""What a step costs the engine beyond reading the weights and the KV cache, measured
on this machine (``tandem plan --hardware cpu`` and ``--measure`` on a GGUF file).

The plan's floors price a step's bytes and FLOPs at the kernels' rates. A real step
also pays for what does not grow with the weights: the scheduler and the sampler in
Python, and every layer's calls (norms, rope, attention over a short context, the
threads meeting after each parallel loop): on a 1B file at batch 1 a noticeable share
of the step, on a 135M model more (docs/lab-notes/real-size-files.md).

It is measured, not modelled: the engine runs a tiny model of the file's own
architecture, layer count, head dimension, attention grouping, vocabulary and
experts, but only ``TINY_WIDTH`` wide, so its matrices are a few hundred KB and its
steps are almost all fixed cost. What the tiny model does read (its LM head at the
real vocabulary, its small matrices) is priced at the measured bandwidth and taken
off. What grows with the model's width and is not a weight read (a norm over 4096
values instead of 256, a prompt's activations) is not in it: a prompt's share of that
is left unpriced.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from tandem.quant.blocks import GGMLType

TINY_WIDTH = 256  # the tiny model's hidden and MLP width: one K-format super-block
TINY_EXPERT_WIDTH = 32  # a tiny expert's rows: one block, so 128 experts stay small
ARCHITECTURES = ("llama", "qwen3moe", "qwen2moe")  # the ones random_gguf writes
DECODE_STEPS = 8  # timed, after a prefill
# The twin's sequences are at most this deep: its KV reads are priced apart (the decode
# attention kernel's rate), and a whole batch of long prompts prefilled in one step
# would take memory for nothing.
MAX_DEPTH = 512
# The largest batch the twin runs: a plan's --batch is the user's to choose, and the
# twin prefills a whole batch in one step. Beyond it the plan extends the line through
# the measured batches (Hardware.step_overhead): the per-sequence cost is linear.
MAX_BATCH = 64
ROUNDS = 3  # medians over rounds of DECODE_STEPS steps each


def tiny_shape(path: Path):
    """The tiny twin of the GGUF file at ``path`` (a random_gguf Shape and its format),
    or None where it cannot be written: an architecture random_gguf does not write, or
    a head dimension that does not divide TINY_WIDTH."""
    from tandem.models.gguf_split import open_gguf
    from tandem.models.random_gguf import Shape
    from tandem.plan.calculator import file_weights, read_model

    architecture = open_gguf(path).fields.get("general.architecture")
    config, _ = read_model(path)
    if architecture not in ARCHITECTURES or TINY_WIDTH % config.head_dim:
        return None
    heads = TINY_WIDTH // config.head_dim
    kv_heads = max(1, heads * config.num_kv_heads // config.num_heads)
    moe = config.moe
    shape = Shape(
        TINY_WIDTH, config.num_layers, heads, kv_heads, TINY_WIDTH,
        config.tie_word_embeddings, vocab=config.vocab_size, head_size=config.head_dim,
        architecture=architecture, experts=moe.num_experts if moe else 0,
        experts_used=moe.top_k if moe else 0,
        expert_intermediate=TINY_EXPERT_WIDTH if moe else 0,
        shared_intermediate=TINY_EXPERT_WIDTH if moe and moe.shared_intermediate_size else 0,
    )  # fmt: skip
    # Q8_0 files stay Q8_0 (another kernel); everything else runs the 4-bit one, whose
    # fixed costs are the K formats' too (one packed tile loop).
    main = file_weights(path).main_format
    return shape, "q8_0" if main == GGMLType.Q8_0 else "q4_0"


def step_overheads(
    path: Path, batches: list[int], prompt_len: int, bandwidth_gbs: float, tflops: float
) -> dict[int, float] | None:
    """The engine's fixed cost of a decode step at each of ``batches`` (at most
    MAX_BATCH sequences, ``prompt_len`` tokens deep, at most MAX_DEPTH), in seconds,
    for the GGUF file at ``path``: the tiny twin's step time less what the plan prices
    its weights at, reading them at ``bandwidth_gbs`` or multiplying them at
    ``tflops``, whichever is slower (its LM head at the real vocabulary is 2 x 128k x
    256 FLOPs a token: at batch 16 it computes longer than it reads). None where no
    twin can be written (tiny_shape)."""
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.executor import make_executor
    from tandem.models.random_gguf import write_random_gguf
    from tandem.plan.calculator import file_weights
    from tandem.plan.calibrate import TimedSteps

    twin = tiny_shape(path)
    if twin is None:
        return None
    shape, fmt = twin
    depth = min(prompt_len, MAX_DEPTH)
    batches = sorted({min(batch, MAX_BATCH) for batch in batches})
    with tempfile.TemporaryDirectory(prefix="tandem-plan-") as scratch:
        tiny = write_random_gguf(Path(scratch) / "tiny.gguf", shape, fmt)
        weights = file_weights(tiny)
        config = EngineConfig.from_kwargs(
            str(tiny), max_model_len=depth + DECODE_STEPS + 2,
            max_num_seqs=max(batches), enable_prefix_caching=False,
            # Every prompt in one step, so that the batch decodes together after it.
            max_num_batched_tokens=max(batches) * (depth + 1),
        )  # fmt: skip
        steps = TimedSteps(Engine(config, make_executor(config)))

        def decoding(batch: int) -> list[float]:
            """Seconds of each step that decoded all of ``batch`` fresh prompts (a pool
            too small for all at once would stagger them)."""
            timed = steps.run([steps.prompt(depth) for _ in range(batch)], DECODE_STEPS + 1)
            return [
                seconds for shares, seconds in timed
                if len(shares) == batch and all(n == 1 for n, _ in shares)
            ]  # fmt: skip

        steps.run([steps.prompt(16)], 2)  # page faults, kernel caches
        measured = {}
        for batch in batches:
            rounds = [statistics.median(decoding(batch)) for _ in range(ROUNDS)]
            # The twin's own weights: its matrices (a mixture's picked experts, at most
            # all of them) and its LM head at the real vocabulary.
            read = weights.read_at(shape.experts, shape.experts_used, batch)
            reads = read / (bandwidth_gbs * 1e9)
            active = weights.active_layer_weights(shape.experts, shape.experts_used)
            flops = 2 * (active + weights.head_weights) * batch / (tflops * 1e12)
            measured[batch] = max(0.0, statistics.median(rounds) - max(reads, flops))
    return measured
