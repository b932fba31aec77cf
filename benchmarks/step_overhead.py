"""Where a decode step's time goes: outside the model forward (scheduling, input
preparation, sampling, output processing) and inside it (weight matmuls, and
everything else: norms, rotary, attention, residual adds, op dispatch).

Per model and batch size, ``batch`` requests with short prompts decode together; every
step after the prompts is timed whole (``engine.step()``) and the model forward inside
it (a timer around the model's ``forward`` and ``compute_logits``); host time is the
difference. The forward is then split into weight matmuls (the same linear layers,
the LM head included, run on their own in model order) and the rest. One step runs
under the torch profiler to count the aten ops dispatched. Medians over decode steps.

Models: the bundled stdlib-lm, and a random-weight Llama shaped like SmolLM2-135M
(30 layers, hidden 576, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied).

    python benchmarks/step_overhead.py [--batch 1 16 64] [--dtype float32]

To compare with an older commit, check it out into a folder and run this file from
there (``python -m`` puts the current folder first on the path; this file only uses
APIs the older engine has too), alternating the two::

    git worktree add /tmp/tandem-old <commit>
    cp benchmarks/step_overhead.py /tmp/tandem-old/benchmarks/
    (cd /tmp/tandem-old && python -m benchmarks.step_overhead)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import tandem
from benchmarks.common import BENCH_DIR, machine
from tandem import LLM, SamplingParams

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)

MATMUL_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul")


def smollm2_shaped_folder() -> Path:
    folder = BENCH_DIR / "smollm2-135m-shape"
    if not (folder / "model.safetensors").is_file():
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(**SMOLLM2_SHAPE)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def bundled_folder() -> Path:
    from tandem.models.bundled import default_model

    return Path(default_model())


class ForwardTimer:
    """Wraps a model's ``forward`` and ``compute_logits`` (the LM head); records the
    wall time of each call."""

    METHODS = ("forward", "compute_logits")

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.seconds: list[float] = []
        for name in self.METHODS:
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, inner):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds.append(time.perf_counter() - start)
            return out

        return call

    def remove(self) -> None:
        for name in self.METHODS:
            delattr(self.model, name)  # the class's method shows through again


def target_model(llm: LLM) -> torch.nn.Module:
    runner = llm.engine.runner
    return runner.model


def measure(llm: LLM, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 131 + j * 7 + 3) % vocab for j in range(prompt_len)]
        engine.add_request(f"ovh-{batch}-{i}", {"prompt_token_ids": prompt}, params)
    timer = ForwardTimer(target_model(llm))
    steps: list[tuple[float, float]] = []
    num_ops = None
    try:
        while engine.has_unfinished_requests():
            timer.seconds.clear()
            start = time.perf_counter()
            engine.step()
            total = time.perf_counter() - start
            steps.append((total, sum(timer.seconds)))
            if num_ops is None and len(steps) == new_tokens // 2:
                num_ops = count_ops(engine)  # (that step is not timed)
    finally:
        timer.remove()
    decode = steps[-(new_tokens - 2) :]  # after every prompt has run
    step = statistics.median(s for s, _ in decode)
    forward = statistics.median(f for _, f in decode)
    matmul = matmul_seconds(target_model(llm), batch)
    return {"step": step, "forward": forward, "host": step - forward, "matmul": matmul,
            "num_ops": num_ops}  # fmt: skip


def count_ops(engine) -> int:
    """aten ops dispatched in one step (under the torch profiler; not timed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def matmul_seconds(model: torch.nn.Module, batch: int, repeats: int = 9) -> float:
    """The weight matmuls of one decode step on their own: every linear layer (the LM
    head included) applied to ``batch`` rows, in model order, so that each weight is
    streamed from memory as in the forward. Median of ``repeats`` passes."""
    linears = [
        m for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and not isinstance(m, torch.nn.Embedding)
    ]  # fmt: skip
    dtype = linears[0].weight.dtype
    inputs = {
        m.weight.shape[1]: torch.randn(batch, m.weight.shape[1], dtype=dtype) for m in linears
    }
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for m in linears:
                m(inputs[m.weight.shape[1]])
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--models", nargs="+", default=["bundled", "smollm2-shape"])
    args = parser.parse_args()
    folders = {"bundled": bundled_folder, "smollm2-shape": smollm2_shaped_folder}
    print(f"machine: {machine()}")
    print(f"tandem from {Path(tandem.__file__).parent}; dtype {args.dtype}")
    print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens; medians of decode steps\n")
    print(
        f"{'model':<15}{'batch':>6}{'step ms':>9}{'forward':>9}{'host':>8}"
        f"{'matmul':>9}{'other':>8}{'aten ops':>10}"
    )
    for name in args.models:
        folder = folders[name]()
        llm = LLM(str(folder), dtype=args.dtype, max_num_seqs=max(args.batch))
        vocab = llm.engine.tokenizer.vocab_size if name == "bundled" else 49152
        for batch in args.batch:
            r = measure(llm, batch, args.prompt_len, args.new_tokens, vocab)
            matmul = r["matmul"]
            print(
                f"{name:<15}{batch:>6}{r['step'] * 1e3:>9.2f}{r['forward'] * 1e3:>9.2f}"
                f"{r['host'] * 1e3:>8.2f}{matmul * 1e3:>9.2f}"
                f"{(r['forward'] - matmul) * 1e3:>8.2f}{r.get('num_ops', 0):>10}"
            )
    print(
        "\nforward: the model's forward and LM head; host: the rest of the step; matmul: "
        "the same linear layers on their own; other: forward - matmul; aten ops: one step"
    )


if __name__ == "__main__":
    main()
