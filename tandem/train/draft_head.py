"""``tandem train-draft``: an EAGLE head (eagle_head.py) trained on the target's own text.

Self-distillation, in three resumable stages under the output folder (``run.json``
records the settings they were made with; a folder of other settings is refused):

1. ``data.pt``: chat prompts built from documents (the docstrings of the Python
   standard library's training split, train/corpus.py, or the paragraphs of the files
   given), each answered greedily by the target through tandem's engine; then one
   no-cache forward of the target over each prompt + answer keeps its final hidden
   states (the features), in bfloat16. Held-out files give the evaluation set.
2. ``checkpoint.pt``: the head trained with the existing loop (train/trainer.py). Per
   position t it reads (f_t, token t + 1) and must predict f_{t+1}: a cross-entropy
   against the target's own distribution there (softmax of the target's LM head on
   f_{t+1}, over the draft vocabulary) plus a smooth-L1 pull towards f_{t+1} (EAGLE-1's
   two losses). A second pass feeds half the positions the head's own first-pass
   predictions instead of the target's features, as drafting beyond the first guess
   does (a light form of EAGLE-3's training-time test). Input features get noise.
3. the head folder itself (``config.json``, ``model.safetensors``), and the held-out
   agreement: how often the head's first and second guesses equal the target's greedy
   tokens there (its acceptance under greedy verification, teacher-forced).
"""

from __future__ import annotations

import ast
import functools
import json
import random
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.errors import InvalidParameterError
from tandem.kernels import cpu as cpu_kernels
from tandem.models.random_weights import initialize
from tandem.runner.attention import CausalAttention
from tandem.spec_decode.draft_settings import DraftTraining
from tandem.spec_decode.eagle_head import EagleHead, save_head
from tandem.train.corpus import split, stdlib_sources
from tandem.train.trainer import TrainConfig, fit

TEMPLATES = [
    "What does this part of Python's standard library do? {doc}",
    'In Python\'s standard library, what does `{name}` do? Its docstring begins: "{first}". '
    "Explain it in a few sentences.",
    "Explain the following documentation to a beginner:\n\n{doc}",
    "Write a short Python example that uses `{name}`. Its documentation says: {first}",
    "Summarize in two sentences: {doc}",
    "What would be a good docstring for a function called `{name}`?",
]
DEFAULT_DOCUMENT_CHARS = 600


def documents(paths: list[str] | None, heldout: bool, wanted: int) -> list[tuple[str, str]]:
    """(name, text) pairs to draw ``wanted`` prompts from: the given files' paragraphs,
    or the stdlib's docstrings of modules, classes and functions (its held-out split
    when ``heldout``)."""
    if paths:
        found = []
        for path in paths:
            try:
                text = Path(path).read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                raise InvalidParameterError("--text", f"cannot read {path}: {exc}") from None
            paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 40]
            found += [(Path(path).stem, p[:DEFAULT_DOCUMENT_CHARS]) for p in paragraphs]
        if not found:
            raise InvalidParameterError("--text", "no paragraph of 40 characters or more")
        # Held out: every 20th paragraph.
        return [d for i, d in enumerate(found) if (i % 20 == 19) == heldout]
    return list(stdlib_documents(heldout, DOCUMENTS_PER_PROMPT * wanted))


DOCUMENTS_PER_PROMPT = 4  # the pool prompts are drawn from, against their count


@functools.cache
def stdlib_documents(heldout: bool, enough: int) -> tuple[tuple[str, str], ...]:
    """Docstrings of the stdlib's files in a fixed shuffled order, until ``enough`` are
    found (or the split runs out): parsing every file takes tens of seconds, and a
    small run needs a few dozen files."""
    train, held = split(stdlib_sources())
    files = held if heldout else train
    random.Random(0).shuffle(files)
    found: list[tuple[str, str]] = []
    for source in files:
        if len(found) >= enough:
            break
        try:
            with warnings.catch_warnings():  # (old escapes in strings)
                warnings.simplefilter("ignore")
                tree = ast.parse(source.text)
        except (SyntaxError, ValueError):
            continue
        module = source.path[:-3].replace("/", ".")
        found += [(name, doc[:DEFAULT_DOCUMENT_CHARS]) for name, doc in docstrings(tree, module)]
    return tuple(found)


def docstrings(tree: ast.Module, module: str):
    """(name, docstring) of the module and of every class and function defined in it,
    nested ones included, 40 characters or longer. Only statement bodies are walked:
    expressions hold no definitions."""
    kinds = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, kinds | ast.Module):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                yield (module if isinstance(node, ast.Module) else node.name), doc
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None) or ()
            statements = ast.stmt | ast.excepthandler
            pending += [c for c in reversed(children) if isinstance(c, statements)]


def prompts_from(docs: list[tuple[str, str]], count: int, seed: int) -> list[str]:
    """``count`` chat questions about randomly chosen documents, templates in turn."""
    rng = random.Random(seed)
    chosen = rng.sample(docs, min(count, len(docs)))
    prompts = []
    for i, (name, doc) in enumerate(chosen):
        first = doc.strip().splitlines()[0]
        prompts.append(TEMPLATES[i % len(TEMPLATES)].format(name=name, doc=doc, first=first))
    return prompts


def answered(
    llm, prompts: list[str], max_tokens: int, progress: bool = True
) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy answer, prompt length) per prompt."""
    from tandem.sampling import SamplingParams

    tokenizer = llm.engine.tokenizer
    inputs = [{"prompt_token_ids": tokenizer.encode_user_prompt(p)} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate(inputs, params, use_tqdm=progress)
    return [
        (list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
        for o in outputs
    ]


@torch.inference_mode()
def target_features(
    loaded, sequences: list[list[int]], progress: bool = True
) -> list[torch.Tensor]:
    """The target's final hidden states over each sequence [L, hidden], bfloat16."""
    from tqdm.auto import tqdm

    features = []
    for ids in tqdm(sequences, desc="features", disable=not progress):
        length = len(ids)
        attn = CausalAttention(1, length, loaded.config.layer_windows())
        positions = torch.arange(length, device=loaded.device)
        hidden = loaded.model(torch.tensor(ids, device=loaded.device), positions, attn)
        features.append(hidden.to(torch.bfloat16).cpu())
    return features


def build_data(llm, text: list[str] | None, settings: DraftTraining, progress: bool = True) -> dict:
    data = {}
    for part, count in (("train", settings.prompts), ("heldout", settings.heldout_prompts)):
        prompts = prompts_from(documents(text, part == "heldout", count), count, settings.seed)
        pairs = answered(llm, prompts, settings.max_tokens, progress)
        sequences = [ids[: settings.seq_len] for ids, _ in pairs]
        data[part] = {
            "sequences": sequences,
            "prompt_lens": [n for _, n in pairs],
            "features": target_features(llm.engine.executor.runner.loaded, sequences, progress),
        }
    return data


def draft_vocabulary(data: dict, size: int, eos_ids: tuple[int, ...], vocab: int) -> torch.Tensor:
    """The ``size`` tokens the target answered with most often (end-of-sequence ids
    always), then the prompts' most frequent ones; sorted ids."""
    answers, prompts = Counter(), Counter()
    for ids, start in zip(data["train"]["sequences"], data["train"]["prompt_lens"], strict=True):
        answers.update(ids[start:])
        prompts.update(ids[:start])
    chosen = dict.fromkeys(i for i in eos_ids if i < vocab)
    for counts in (answers, prompts):
        for token, _ in counts.most_common():
            if len(chosen) >= size:
                break
            chosen.setdefault(token)
    for token in range(vocab):  # a tiny corpus: fill up with the lowest ids
        if len(chosen) >= min(size, vocab):
            break
        chosen.setdefault(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


class Batches:
    """Padded batches of one data split: the tokens' embeddings (the target's, frozen),
    the features, and which positions have a next feature to learn."""

    def __init__(self, part: dict, embed) -> None:
        self.sequences = part["sequences"]
        self.features = part["features"]
        self.embed = embed

    def batch(self, indices: list[int]):
        length = max(len(self.sequences[i]) for i in indices)
        hidden = self.features[0].shape[1]
        tokens = torch.zeros(len(indices), length, dtype=torch.long)
        features = torch.zeros(len(indices), length, hidden)
        mask = torch.zeros(len(indices), length, dtype=torch.bool)
        for row, i in enumerate(indices):
            n = len(self.sequences[i])
            tokens[row, :n] = torch.tensor(self.sequences[i])
            features[row, :n] = self.features[i].float()
            mask[row, : n - 1] = True  # position t needs f_{t+1}
        with torch.no_grad():
            embeds = self.embed(tokens.flatten()).float().view(*tokens.shape, -1)
        return embeds, features, mask


def head_passes(
    head: EagleHead, embeds, features, mask, noise: float, generator=None, mix: float = 0.5
):
    """Both training passes over a padded batch -> (first-pass predictions, second-pass
    predictions, targets f_{t+1}, mask), all [B, L - 1, ...] but the mask."""
    batch, length, hidden = features.shape
    inputs, targets = features[:, :-1], features[:, 1:]
    next_embeds = embeds[:, 1:]
    if noise:
        scale = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        jitter = torch.randn(inputs.shape, generator=generator) * noise * scale
        inputs = inputs + jitter
    positions = torch.arange(length - 1).repeat(batch)

    def run(x: torch.Tensor) -> torch.Tensor:
        attn = CausalAttention(batch, length - 1)
        flat = head.predict(next_embeds.flatten(0, 1), x.flatten(0, 1), positions, attn)
        return flat.view(batch, length - 1, hidden)

    first = run(inputs)
    # Second pass: a share ``mix`` of the positions read the first pass's prediction of
    # their feature (made one position before), as guesses after the first do.
    own = torch.cat([inputs[:, :1], first[:, :-1].detach()], dim=1)
    pick = torch.rand(inputs.shape[:2], generator=generator) < mix
    second = run(torch.where(pick[..., None], own, inputs))
    return first, second, targets, mask[:, :-1]


def head_loss(head: EagleHead, predicted, targets, mask, regression_weight: float):
    rows = head.lm_head.weight
    chosen = mask.flatten()
    predicted, targets = predicted.flatten(0, 1)[chosen], targets.flatten(0, 1)[chosen]
    with torch.no_grad():
        teacher = torch.softmax(targets @ rows.T, dim=-1)
    ce = F.cross_entropy(predicted @ rows.T, teacher)
    return ce + regression_weight * F.smooth_l1_loss(predicted, targets)


@torch.no_grad()
def agreement(head: EagleHead, part: dict, embed) -> tuple[float, float]:
    """On a held-out split of greedy answers: how often the head's first guess (from
    the target's features) and its second (every input its own prediction: a lower
    bound) equal the target's next greedy token, over answer tokens."""
    hits, total = [0, 0], 0
    batches = Batches(part, embed)
    for i, (ids, start) in enumerate(zip(part["sequences"], part["prompt_lens"], strict=True)):
        if len(ids) < max(3, start + 1):
            continue
        embeds, features, mask = batches.batch([i])
        first, second, _, _ = head_passes(head, embeds, features, mask, 0.0, mix=1.0)
        # Position t reads token t + 1 and guesses token t + 2; answer tokens only.
        want = torch.tensor(ids[max(2, start) :])
        for slot, predicted in enumerate((first, second)):
            scores = predicted[0, max(0, start - 2) : len(ids) - 2] @ head.lm_head.weight.T
            guess = head.draft_vocab[scores.argmax(-1)]
            hits[slot] += int((guess == want).sum())
        total += len(want)
    return hits[0] / max(1, total), hits[1] / max(1, total)


def _same_run(out: Path, settings: dict) -> None:
    """``out`` holds this run or nothing: its stages are reused only under the same
    settings (``steps`` may grow: the schedule is extended)."""
    record = out / "run.json"
    settings = {k: v for k, v in settings.items() if k != "steps"}
    if not record.is_file():
        record.write_text(json.dumps(settings, indent=2) + "\n")
        return
    before = json.loads(record.read_text())
    changed = sorted(k for k in settings.keys() | before.keys() if settings.get(k) != before.get(k))
    if changed:
        raise InvalidParameterError(
            "--out", f"{out} holds a run with other {', '.join(changed)}: use a new folder"
        )


def train_draft(
    target: str,
    out: str | Path,
    text: list[str] | None = None,
    settings: DraftTraining | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> dict:
    """Every stage not already done in ``out``; returns the run's summary (also in the
    head's config.json). ``stop_at``: stop after that training step, checkpointed."""
    from tandem.llm import LLM

    settings = settings or DraftTraining()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _same_run(out, {**asdict(settings), "target": str(target), "text": text})
    llm = LLM(target)
    loaded = llm.engine.executor.runner.loaded
    data_path = out / "data.pt"
    if data_path.is_file():
        data = torch.load(data_path, weights_only=False)
    else:
        data = build_data(llm, text, settings, progress)
        torch.save(data, data_path)
    vocab = draft_vocabulary(
        data, settings.draft_vocab_size, loaded.eos_token_ids, loaded.config.vocab_size
    )
    head = EagleHead(loaded.config, vocab)
    head.attach(loaded.model)
    initialize(head, torch.Generator().manual_seed(settings.seed))  # (not the frozen rows)
    batches = Batches(data["train"], loaded.model.embed)
    config = TrainConfig(
        steps=settings.steps,
        batch_size=settings.batch_size,
        seq_len=settings.seq_len,
        lr=settings.lr,
        min_lr=settings.lr / 10,
        warmup_steps=min(50, settings.steps // 10 + 1),
        weight_decay=0.0,
        seed=settings.seed,
    )

    bf16 = settings.bf16 if settings.bf16 is not None else cpu_kernels.has_bf16_units()

    def loss(generator: torch.Generator) -> torch.Tensor:
        count = len(batches.sequences)
        indices = torch.randint(0, count, (settings.batch_size,), generator=generator).tolist()
        embeds, features, mask = batches.batch(indices)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            first, second, targets, mask = head_passes(
                head, embeds, features, mask, settings.feature_noise, generator
            )
            weight = settings.regression_weight
            return head_loss(head, first, targets, mask, weight) + head_loss(
                head, second, targets, mask, weight
            )

    mean_len = sum(map(len, batches.sequences)) / max(1, len(batches.sequences))
    head.requires_grad_(True)
    head.lm_head.weight.requires_grad_(False)
    losses = fit(
        head, config, loss, int(settings.batch_size * mean_len), out / "checkpoint.pt",
        progress, stop_at,
    )  # fmt: skip
    first, second = agreement(head, data["heldout"], loaded.model.embed)
    summary = {
        "settings": asdict(settings),
        "train_sequences": len(data["train"]["sequences"]),
        "train_tokens": sum(map(len, data["train"]["sequences"])),
        "steps_done": len(losses),
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
        "heldout_first_guess_agreement": first,
        "heldout_second_guess_agreement": second,
    }
    if len(losses) == settings.steps:  # finished: the head folder
        save_head(head, out, str(target), summary)
    return summary
