"""Train tandem's bundled models on the Python standard library and write them to models/.

    python scripts/train_bundled_models.py [--target-schedule 650,1300] [--draft-schedule 650]

Steps: corpus (the running interpreter's stdlib, split by path hash) -> byte-level BPE
tokenizer -> target model and draft model (Llama architecture, tandem's own no-cache
forward) -> held-out evaluation (loss, bits per byte, unigram baseline, the draft's
greedy agreement with the target) -> Hugging Face folders with model cards.

Deterministic given --seed; interrupted runs resume from the checkpoints in
--work-dir (rerun the same command).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.models.random_weights import model_parameters, random_model
from tandem.models.saver import save_pretrained
from tandem.runner.model_runner import forward_no_cache
from tandem.train.bpe import END_OF_TEXT, save_tokenizer, train_bpe
from tandem.train.corpus import split, stdlib_root, stdlib_sources
from tandem.train.trainer import TrainConfig, train

CONTEXT = 1024
# The recommended sampling written to generation_config.json (what `tandem generate`
# and `LLM.generate` use unless told otherwise): greedy with a repetition penalty. A
# model this small falls into loops under plain greedy decoding; chosen by reading
# completions of a few prompts, not by a metric.
SAMPLING = {"do_sample": False, "repetition_penalty": 1.3}


def llama_config(
    vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, eos: int
):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
    }


def token_stream(tokenizer, texts: list[str], eos: int) -> torch.Tensor:
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(tokens: torch.Tensor, window: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping (input, next-token target) windows of ``tokens``."""
    usable = (len(tokens) - 1) // window * window
    return tokens[:usable].view(-1, window), tokens[1 : usable + 1].view(-1, window)


@torch.no_grad()
def evaluate(loaded, tokens: torch.Tensor) -> float:
    """Mean next-token loss (nats) over non-overlapping windows of ``tokens``."""
    inputs, targets = windows(tokens)
    total = 0.0
    for start in range(0, len(inputs), 8):
        logits = forward_no_cache(loaded, inputs[start : start + 8])
        total += F.cross_entropy(
            logits.flatten(0, 1), targets[start : start + 8].flatten(), reduction="sum"
        ).item()
    return total / targets.numel()


@torch.no_grad()
def greedy_agreement(target, draft, tokens: torch.Tensor) -> float:
    """How often the draft's argmax equals the target's, teacher-forced on held-out text."""
    inputs, _ = windows(tokens)
    agree = 0
    for start in range(0, len(inputs), 8):
        batch = inputs[start : start + 8]
        agree += (
            (
                forward_no_cache(target, batch).argmax(-1)
                == forward_no_cache(draft, batch).argmax(-1)
            )
            .sum()
            .item()
        )
    return agree / inputs.numel()


def unigram_loss(train_tokens: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train_tokens, minlength=vocab).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return -log_probs[heldout[1:]].mean().item()


def model_card(name: str, facts: dict) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in facts.items())
    return f"""# {name}

A small Llama-architecture model trained by tandem on the Python standard library
(`scripts/train_bundled_models.py`, deterministic given its seed). It completes Python
source; it is not a chat assistant. Random-weight checkpoints are no substitute for
it when a command should print something readable, and speculative decoding and
quantization use it (and its draft) for real acceptance and quality numbers.

| | |
|---|---|
{rows}

Bits per byte = held-out loss in nats / ln 2 x tokens / bytes of the held-out text.
Held-out files: 5% of the stdlib, chosen by a hash of each file's relative path.

Recommended sampling (in `generation_config.json`): greedy with `repetition_penalty`
1.3. Plain greedy decoding loops at this size (`import os` -> `_path_path_path...`).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models")
    parser.add_argument("--work-dir", default="build/train")
    # Each number is a run to that step on a cosine schedule of that length, resumed
    # from the previous run: "650,1300" trains 650 steps, then restarts the schedule
    # warm and continues to 1300 (how the shipped target was made).
    parser.add_argument("--target-schedule", default="650,1300")
    parser.add_argument("--draft-schedule", default="650")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus-dir", default=None, help="default: the whole stdlib")
    parser.add_argument("--heldout-percent", type=int, default=5)
    args = parser.parse_args()
    vocab = args.vocab_size
    torch.manual_seed(args.seed)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)

    corpus_dir = Path(args.corpus_dir) if args.corpus_dir else stdlib_root()
    sources = stdlib_sources(corpus_dir)
    train_files, heldout_files = split(sources, args.heldout_percent)
    train_text = [s.text for s in train_files]
    heldout_text = [s.text for s in heldout_files]
    print(f"corpus: {corpus_dir}: {len(train_files)} train / {len(heldout_files)} held-out files")
    tokenizer = train_bpe(train_text, vocab)
    eos = tokenizer.token_to_id(END_OF_TEXT)
    train_tokens = token_stream(tokenizer, train_text, eos)
    heldout_tokens = token_stream(tokenizer, heldout_text, eos)
    heldout_bytes = sum(len(t.encode()) for t in heldout_text) + len(heldout_text)
    bytes_per_token = heldout_bytes / len(heldout_tokens)
    print(f"tokens: {len(train_tokens):,} train, {len(heldout_tokens):,} held-out")

    def bpb(loss: float) -> float:
        return loss / math.log(2) / bytes_per_token

    baseline = bpb(unigram_loss(train_tokens, heldout_tokens, vocab))

    specs = {
        "stdlib-lm": (llama_config(vocab, 256, 6, 8, 4, 768, eos), args.target_schedule),
        "stdlib-lm-draft": (llama_config(vocab, 128, 2, 4, 2, 256, eos), args.draft_schedule),
    }
    trained, facts = {}, {}
    for name, (raw, schedule) in specs.items():
        loaded = random_model(raw, dtype="float32", seed=args.seed)
        print(f"training {name}: {model_parameters(loaded.model) / 1e6:.2f}M parameters")
        for steps in (int(n) for n in schedule.split(",")):
            config = TrainConfig(steps=steps, batch_size=8, seq_len=512, seed=args.seed)
            losses = train(loaded, train_tokens, config, work / f"{name}.pt")
        state = torch.load(work / f"{name}.pt", weights_only=False)
        history = ", then ".join(
            f"steps {first}-{last} of a {length}-step schedule"
            for first, last, length in state["segments"]
        )
        loss = evaluate(loaded, heldout_tokens)
        trained[name] = loaded
        facts[name] = {
            "parameters": f"{model_parameters(loaded.model):,}",
            "architecture": (
                f"Llama: hidden {raw['hidden_size']}, {raw['num_hidden_layers']} layers, "
                f"{raw['num_attention_heads']} heads / {raw['num_key_value_heads']} KV heads, "
                f"intermediate {raw['intermediate_size']}, context {CONTEXT}, tied embeddings"
            ),
            "tokenizer": f"byte-level BPE, {vocab} tokens, trained on the train split",
            "training tokens": f"{steps * config.batch_size * config.seq_len:,} "
            f"({steps} steps x {config.batch_size} x {config.seq_len})",
            "training time": f"{state['seconds'] / 60:.1f} min on 2 CPU cores",
            "training runs": history,
            "final training loss": f"{sum(losses[-20:]) / len(losses[-20:]):.3f} nats/token",
            "held-out loss": f"{loss:.3f} nats/token",
            "held-out bits per byte": f"{bpb(loss):.3f}",
            "unigram baseline": f"{baseline:.3f} bits per byte",
        }
    agreement = greedy_agreement(
        trained["stdlib-lm"], trained["stdlib-lm-draft"], heldout_tokens[:65537]
    )
    for name in specs:
        facts[name]["draft greedy agreement with target"] = (
            f"{agreement:.1%} (teacher-forced, held-out)"
        )
        folder = out / name
        save_pretrained(
            trained[name].model,
            specs[name][0],
            folder,
            generation_config={"eos_token_id": eos, "bos_token_id": eos, **SAMPLING},
        )
        save_tokenizer(tokenizer, folder, model_max_length=CONTEXT)
        (folder / "README.md").write_text(model_card(name, facts[name]))
        print(json.dumps({name: facts[name]}, indent=2))


if __name__ == "__main__":
    main()
