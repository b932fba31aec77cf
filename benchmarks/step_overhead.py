"""Where a decode step's time goes: outside the model forward (scheduling, input
preparation, sampling, output processing) and inside it (weight matmuls, and
everything else: norms, rotary, attention, residual adds, op dispatch).

Per model and batch size, ``batch`` requests with short prompts decode together; every
step after the prompts is timed whole (``engine.step()``) and the model forward inside
it (a timer around the model's ``forward`` and ``compute_logits``); host time is the
difference. Three steps in the middle time every linear layer (hooks around each
call, the LM head included), which splits the forward into weight matmuls and the
rest; one more runs under the torch profiler to count the aten ops dispatched.
Medians over decode steps.

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
import resource
import statistics
import time
from pathlib import Path

import torch

import tandem
from benchmarks.common import machine, smollm2_shaped_folder
from benchmarks.decode_roofline import transformers_step_seconds
from tandem import LLM, SamplingParams


def bundled_folder() -> Path:
    from tandem.models.catalog import DEFAULT_MODEL

    return DEFAULT_MODEL


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


def measure(
    llm: LLM, batch: int, prompt_len: int, new_tokens: int, vocab: int, penalty: float = 1.0
) -> dict:
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, repetition_penalty=penalty
    )
    for i in range(batch):
        prompt = [(i * 131 + j * 7 + 3) % vocab for j in range(prompt_len)]
        engine.add_request(f"ovh-{batch}-{i}", {"prompt_token_ids": prompt}, params)
    model = engine.executor.runner.model
    timer = ForwardTimer(model)
    steps: list[tuple[float, float]] = []
    matmul = num_ops = None
    kernels: dict[str, float] = {}
    try:
        while engine.has_unfinished_requests():
            timer.seconds.clear()
            faults = minor_faults()
            start = time.perf_counter()
            engine.step()
            total = time.perf_counter() - start
            steps.append((total, sum(timer.seconds), minor_faults() - faults))
            if matmul is None and len(steps) == new_tokens // 2:  # (steps not timed)
                matmul = matmul_seconds(engine, model)
                num_ops = count_ops(engine)
                kernels = kernel_seconds(engine)
    finally:
        timer.remove()
    decode = steps[-(new_tokens - 2) :]  # after every prompt has run
    step = statistics.median(s for s, _, _ in decode)
    forward = statistics.median(f for _, f, _ in decode)
    faults = statistics.fmean(n for _, _, n in decode)  # bursty: a mean, not a median
    return {"step": step, "forward": forward, "host": step - forward, "matmul": matmul,
            "num_ops": num_ops, "faults": faults, "kernels": kernels}  # fmt: skip


def minor_faults() -> int:
    """Minor page faults of this process so far (a fresh mapping touched page by page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module holding a weight matrix that multiplies activations (the LM head
    included; a tied head shares the embedding's weight but is its own module)."""
    from tandem.models.quantized import packed_parts

    return [
        m for m in model.modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
        and (m.weight.dim() == 2 or packed_parts(m))  # quantized layers keep no float weight
        and not isinstance(m, torch.nn.Embedding)
    ]  # fmt: skip


def matmul_seconds(engine, model: torch.nn.Module, num_steps: int = 3) -> float:
    """Seconds per step spent inside the linear layers (forward hooks around each
    call, whatever kernel it runs: BLAS, oneDNN or tandem's), over ``num_steps``."""
    spent = [0.0]
    started: dict[int, float] = {}

    def before(module, args):
        started[id(module)] = time.perf_counter()

    def after(module, args, output):
        spent[0] += time.perf_counter() - started[id(module)]

    handles = []
    for module in linear_layers(model):
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        for handle in handles:
            handle.remove()
    return spent[0] / num_steps


def kernel_seconds(engine, num_steps: int = 5) -> dict[str, float]:
    """Seconds per step inside each compiled kernel (tandem/kernels/), over
    ``num_steps``: every call through the module is timed (the module is swapped for
    a timing proxy, then put back). What is neither kernel time nor host time is
    Python and torch dispatch between the kernels."""
    from collections import defaultdict

    from tandem.kernels import cpu as cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        return {}
    spent: dict[str, float] = defaultdict(float)

    class Timed:
        def __getattr__(self, name):
            inner = getattr(module, name)

            def call(*args):
                start = time.perf_counter()
                out = inner(*args)
                spent[name] += time.perf_counter() - start
                return out

            return call

    original = cpu_kernels.load
    cpu_kernels.load = lambda: Timed()
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        cpu_kernels.load = original
    return {name: seconds / num_steps for name, seconds in spent.items()}


def count_ops(engine) -> int:
    """aten ops dispatched in one step (under the torch profiler; tandem's compiled
    kernels are single calls it does not count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["bundled", "smollm2-shape"],
        help="bundled, smollm2-shape, or any model path / catalog name (smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="(the bundled model's own: 1.3)"
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also split the forward into each compiled kernel's time and the rest",
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also time transformers' decode step (on the SmolLM2-shaped model)",
    )
    args = parser.parse_args()
    folders = {"bundled": bundled_folder, "smollm2-shape": smollm2_shaped_folder}
    print(f"machine: {machine()}")
    print(f"tandem from {Path(tandem.__file__).parent}; dtype {args.dtype}")
    print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens; medians of decode steps\n")
    print(
        f"{'model':<15}{'batch':>6}{'step ms':>9}{'forward':>9}{'host':>8}"
        f"{'matmul':>9}{'other':>8}{'aten ops':>10}{'faults':>8}"
    )
    for name in args.models:
        folder = folders[name]() if name in folders else name  # or a path / catalog name
        llm = LLM(str(folder), dtype=args.dtype, max_num_seqs=max(args.batch))
        vocab = llm.engine.executor.runner.model.config.vocab_size
        hf_model = None
        if args.transformers and vocab >= 32000:  # its prompts use ids below 32000
            import transformers

            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=getattr(torch, args.dtype)
            ).eval()
        for batch in args.batch:
            r = measure(
                llm, batch, args.prompt_len, args.new_tokens, vocab, args.repetition_penalty
            )
            matmul = r["matmul"]
            print(
                f"{name:<15}{batch:>6}{r['step'] * 1e3:>9.2f}{r['forward'] * 1e3:>9.2f}"
                f"{r['host'] * 1e3:>8.2f}{matmul * 1e3:>9.2f}"
                f"{(r['forward'] - matmul) * 1e3:>8.2f}{r['num_ops']:>10.0f}{r['faults']:>8.0f}"
            )
            if args.kernels and r["kernels"]:
                inside = sum(r["kernels"].values())
                parts = ", ".join(
                    f"{k} {v * 1e3:.2f}"
                    for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1])
                )
                print(
                    f"{'':<15}{'':>6}  compiled kernels {inside * 1e3:.2f} ms ({parts}); "
                    f"between them {(r['forward'] - inside) * 1e3:.2f} ms"
                )
            if hf_model is not None:
                hf = transformers_step_seconds(hf_model, batch, args.prompt_len, args.new_tokens)
                print(f"{'  transformers':<15}{batch:>6}{hf * 1e3:>9.2f}")
    print(
        "\nforward: the model's forward and LM head; host: the rest of the step; matmul: "
        "time inside linear layers; other: forward - matmul; aten ops: per step; faults: "
        "minor page faults per step"
    )


if __name__ == "__main__":
    main()
