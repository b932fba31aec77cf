"""Decode speed against the roofline, with transformers as a peer.

A decode step must read every weight once and do 2 x params FLOPs per sequence, so its
floor is ``max(weight bytes / bandwidth, 2 x params x batch / peak FLOP/s)``. Both
roofs are measured in the same run (reading a 1 GiB tensor: memory_bandwidth_gbs; a
1024^3 matmul in the model's dtype). We report per-step time, tokens/s, achieved GB/s
(weight bytes read per second, as gpt-fast prints) and the fraction of the floor
reached; transformers' generate on the same weights runs in the same process.

    python benchmarks/decode_roofline.py [--batch 1 16] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import llama_125m_folder, machine
from tandem import LLM, SamplingParams
from tandem.plan.measure import matmul_tflops, memory_bandwidth_gbs


def tandem_step_seconds(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median decode step: time between consecutive tokens with ``batch`` requests."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"b{i}", {"prompt_token_ids": [(i * 7 + j) % 32000 for j in range(prompt_len)]}, params
        )
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    decode_steps = step_times[-(new_tokens - 1) :]
    return statistics.median(decode_steps)


def transformers_step_seconds(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor([[(i * 7 + j) % 32000 for j in range(prompt_len)] for i in range(batch)])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return (total - prefill) / (new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    folder = llama_125m_folder()
    bandwidth = memory_bandwidth_gbs()
    print(f"machine: {machine()}; measured read bandwidth {bandwidth:.1f} GB/s")
    print(f"prompt {args.prompt_len}, {args.new_tokens} new tokens; step = median decode step\n")
    header = (
        f"{'dtype':<10}{'batch':>6}  {'engine':<14}{'step ms':>9}{'tok/s':>9}{'GB/s':>7}"
        f"{'of floor':>10}"
    )
    print(header)
    for dtype in args.dtype:
        llm = LLM(str(folder), dtype=dtype, max_num_seqs=max(args.batch))
        weight_bytes = sum(
            p.numel() * p.element_size() for p in llm.engine.executor.runner.model.parameters()
        )
        params = sum(p.numel() for p in llm.engine.executor.runner.model.parameters())
        tflops = matmul_tflops(getattr(torch, dtype))
        memory_floor = weight_bytes / (bandwidth * 1e9)
        hf_model = None
        if not args.skip_transformers:
            import transformers

            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=getattr(torch, dtype)
            ).eval()
        for batch in args.batch:
            floor = max(memory_floor, 2 * params * batch / (tflops * 1e12))
            rows = [("tandem", tandem_step_seconds(llm, batch, args.prompt_len, args.new_tokens))]
            if hf_model is not None:
                seconds = transformers_step_seconds(
                    hf_model, batch, args.prompt_len, args.new_tokens
                )
                rows.append(("transformers", seconds))
            for name, step in rows:
                print(
                    f"{dtype:<10}{batch:>6}  {name:<14}{step * 1e3:>9.1f}{batch / step:>9.1f}"
                    f"{weight_bytes / step / 1e9:>7.1f}{floor / step:>9.0%}"
                )
        balance = memory_floor * tflops * 1e12 / (2 * params)
        print(
            f"{'':<10}roofs: {weight_bytes / 1e6:.0f} MB of weights / {bandwidth:.1f} GB/s = "
            f"{memory_floor * 1e3:.1f} ms; {tflops * 1e3:.0f} GFLOP/s matmul peak; "
            f"compute-bound above batch {balance:.0f}\n"
        )


if __name__ == "__main__":
    main()
