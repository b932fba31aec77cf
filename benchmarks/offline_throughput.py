"""Offline throughput: tandem's continuous batching against transformers' generate.

The same random-weight ~125M Llama (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000), the same dtype and threads. 64 requests with prompt
lengths uniform in 32..512 and output lengths uniform in 16..256, EOS ignored.
transformers runs static batches of 16 (left-padded; a batch lasts as long as its
longest output); tandem takes all 64 at once. Throughput counts each request's own
output tokens.

    python benchmarks/offline_throughput.py [--dtype float32 bfloat16] [--num-requests 64]
                                            [--device cuda] [--max-num-batched-tokens 8192]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import llama_125m_folder, machine
from tandem import LLM, SamplingParams


def workload(num_requests: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(32000) for _ in range(rng.randint(32, 512))] for _ in range(num_requests)
    ]
    outputs = [rng.randint(16, 256) for _ in range(num_requests)]
    return prompts, outputs


def run_transformers(folder, dtype, prompts, outputs, batch_size: int, device: str) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model = model.to(device).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = [[0] * (width - len(p)) + [1] * len(p) for p in batch]
            mask = torch.tensor(mask, device=device)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outputs[first : first + batch_size]),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_tandem(folder, dtype, prompts, outputs, device: str, budget: int) -> tuple[float, int]:
    llm = LLM(str(folder), dtype=dtype, device=device, max_num_seqs=len(prompts),
              max_num_batched_tokens=budget)  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    return elapsed, produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--skip-transformers", action="store_true", help="tandem only (e.g. old vs new)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = parser.parse_args()
    folder = llama_125m_folder()
    prompts, outputs = workload(args.num_requests)
    useful = sum(outputs)
    print(f"machine: {machine()}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))  # fmt: skip
    print(
        f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {useful} output tokens\n"
    )
    print(f"{'dtype':<10}{'engine':<28}{'seconds':>9}{'out tok/s':>11}{'vs HF':>8}")
    for dtype in args.dtype:
        ours, produced = run_tandem(
            folder, dtype, prompts, outputs, args.device, args.max_num_batched_tokens
        )
        assert produced == useful
        if args.skip_transformers:
            print(f"{dtype:<10}{'tandem (continuous)':<28}{ours:>9.1f}{useful / ours:>11.1f}")
            continue
        torch_dtype = getattr(torch, dtype)
        hf_seconds = run_transformers(
            folder, torch_dtype, prompts, outputs, args.hf_batch_size, args.device
        )
        hf_label = f"transformers (batches of {args.hf_batch_size})"
        print(f"{dtype:<10}{hf_label:<28}{hf_seconds:>9.1f}{useful / hf_seconds:>11.1f}{1:>7.2f}x")
        print(
            f"{dtype:<10}{'tandem (continuous)':<28}{ours:>9.1f}{useful / ours:>11.1f}"
            f"{hf_seconds / ours:>7.2f}x"
        )


if __name__ == "__main__":
    main()
