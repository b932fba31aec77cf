"""The EAGLE draft head: one decoder layer that predicts the target's next hidden state.

EAGLE-1's idea (Li et al., 2024): the target's last hidden state (its "feature", what
the LM head reads) is far easier to extrapolate than its tokens. At position t the head
reads the feature f_t together with the embedding of the token at t + 1 (the token
that feature chose), mixes them with a projection, runs one decoder layer over the
positions before (its own K/V), and predicts f_{t+1}; the target's LM head turns that
into the next token's distribution. Drafting further, it feeds its own prediction in
place of the feature the target has not computed yet.

What it owns: two input norms, the projection ``fc`` [2 hidden -> hidden], one decoder
layer shaped as the target's, and an output norm. What it borrows, frozen: the target's
token embedding (looked up, never copied) and the rows of the target's LM head for its
*draft vocabulary*, the ``draft_vocab_size`` tokens the target emits most often in the
training data (EAGLE-3's reduced vocabulary): a draft step reads 8k LM-head rows, not
49k, and a target token outside them is simply never guessed (verification stays exact).

A head folder holds ``config.json`` (architecture ``TandemEagleHead``, the target's
shape it was trained for, the draft vocabulary size) and ``model.safetensors`` (the
head's own weights in bfloat16, and the draft vocabulary's token ids); ``tandem
train-draft`` writes it (train/draft_head.py), the ``eagle`` proposer runs it
(spec_decode/eagle.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.models.layers import RMSNorm, RotaryEmbedding
from tandem.models.linear import Linear
from tandem.models.llama import LlamaDecoderLayer
from tandem.models.sharding import vocab_rows

ARCHITECTURE = "TandemEagleHead"
FIELD = "speculative_config.model"


class EagleHead(nn.Module):
    """``forward(input_ids, positions, attn)`` is a model's forward (the ``eagle``
    proposer runs it on a runner of its own, with a paged K/V cache of one layer):
    the tokens are those at t + 1, and ``self.features`` must hold f_t for the same rows
    (set just before each call). It returns the predicted f_{t+1}; ``compute_logits``
    scores them over the draft vocabulary."""

    def __init__(self, target_config, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        config = dataclasses.replace(
            target_config, num_layers=1, sliding_layers=None, recurrent_layers=(),
            recurrent_state=(),
        )  # fmt: skip
        self.config = config  # one attention layer shaped as the target's
        self.target_config = target_config
        hidden = config.hidden_size
        self.token_norm = RMSNorm(hidden, config.norm_eps)
        self.feature_norm = RMSNorm(hidden, config.norm_eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, 0)
        self.out_norm = RMSNorm(hidden, config.norm_eps)
        assert config.rope is not None, "EAGLE heads are for rotary (Llama-family) targets"
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long))
        # The target's LM-head rows of the draft vocabulary (frozen, filled by ``attach``;
        # not saved).
        self.lm_head = Linear(hidden, len(draft_vocab), bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.features: torch.Tensor | None = None
        self.embed_tokens = None  # the target's lookup (attach)

    def attach(self, target_model: nn.Module, tp=None) -> None:
        """Borrow the target's embedding and its LM head's draft-vocabulary rows (``tp``:
        the target is a tensor-parallel rank's shard; every rank attaches together)."""
        self.embed_tokens = target_model.embed
        with torch.no_grad():
            rows = lm_head_rows(target_model, self.draft_vocab, tp)
            self.lm_head.weight = nn.Parameter(rows.float(), requires_grad=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn
    ) -> torch.Tensor:  # fmt: skip
        features, self.features = self.features, None
        if features is None or len(features) != len(input_ids):
            raise RuntimeError("EagleHead needs .features for each of its input rows")
        embeds = self.embed_tokens(input_ids).to(features.dtype)
        return self.predict(embeds, features, positions, attn)

    def predict(self, embeds, features, positions, attn) -> torch.Tensor:
        """Flat rows: embeddings of tokens t + 1 and features f_t -> predicted f_{t+1}."""
        x = self.fc(torch.cat([self.token_norm(embeds), self.feature_norm(features)], dim=-1))
        rope = self.rotary.prepare(positions, x.dtype)
        h, residual = self.layer(x, None, self.rotary, rope, attn)
        return self.out_norm(h, residual)[0]

    def compute_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [T, draft_vocab_size]."""
        return self.lm_head(predicted).float()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a head folder stores: everything but the borrowed LM-head rows."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("lm_head.")}


def lm_head_rows(target_model: nn.Module, ids: torch.Tensor, tp=None) -> torch.Tensor:
    """Rows ``ids`` of the target's LM head, dequantized: the embedding's rows when
    they are tied (a quantized embedding dequantizes just those rows). ``tp``: the
    target holds a tensor-parallel rank's vocabulary rows; each rank gives those it
    holds, zeros for the others, and an all-reduce assembles them (every rank calls
    it; a tied embedding's lookup does the same by itself)."""
    if target_model.config.tie_word_embeddings:
        return target_model.embed(ids)
    if tp is None:
        return _own_head_rows(target_model.lm_head, ids)
    held = vocab_rows(target_model.config.vocab_size, tp.size, tp.rank)
    local = ids - held.start
    outside = (local < 0) | (local >= len(held))
    rows = _own_head_rows(target_model.lm_head, local.masked_fill(outside, 0)).float()
    rows = rows.masked_fill(outside.unsqueeze(-1), 0).contiguous()
    tp.comm.all_reduce(rows)
    return rows


def _own_head_rows(head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an LM head this process holds whole (packed or float)."""
    parts = getattr(head, "packed_parts", [])
    if parts:
        start, packed = parts[0]
        if len(parts) != 1 or start != 0:
            raise ModelLoadError("the target's LM head is stored in several parts")
        return packed.dequantize_rows(ids)
    return head.weight[ids]


def target_signature(config) -> dict:
    """The target shape a head is trained for (checked when it is loaded)."""
    return {
        "architecture": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
    }


def save_head(head: EagleHead, folder: str | Path, target_name: str, training: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCHITECTURE],
        "target": {"model": target_name, **target_signature(head.target_config)},
        "draft_vocab_size": len(head.draft_vocab),
        "training": training,
    }
    state = {  # weights in bfloat16 (half the bytes; the loader widens them to float32)
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in head.trainable_state().items()
    }
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def head_config(folder: str | Path) -> dict | None:
    """A head folder's config.json, or None when ``folder`` is not a head's."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    is_head = isinstance(config, dict) and ARCHITECTURE in config.get("architectures", [])
    return config if is_head else None


def load_head(
    folder: str | Path, target_model: nn.Module, target_config=None, tp=None
) -> EagleHead:
    """A head folder -> the head, attached to ``target_model`` (float32, on its
    device). Errors name ``speculative_config.model``. ``target_config``: the whole
    model's, where ``target_model`` is a tensor-parallel rank's shard (``tp``): the
    head is built whole on every rank."""
    target_config = target_config or target_model.config
    folder = Path(folder)
    config = head_config(folder)
    if config is None:
        raise InvalidParameterError(
            FIELD, f"{folder} is not an EAGLE head folder (tandem train-draft makes one)"
        )
    expected = {k: v for k, v in config["target"].items() if k != "model"}
    actual = target_signature(target_config)
    if expected != actual:
        raise InvalidParameterError(
            FIELD,
            f"the head in {folder} was trained for {config['target'].get('model')} "
            f"({expected}); this target is {actual}",
        )
    if not hasattr(target_model, "skipped_layers"):  # the Llama family's marker
        raise InvalidParameterError(FIELD, "EAGLE heads need a Llama-family target")
    state = load_file(str(folder / "model.safetensors"))
    head = EagleHead(target_config, state["draft_vocab"])
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.startswith("lm_head.")]
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: missing {missing}, unexpected {unexpected}")
    device = next(target_model.parameters()).device
    head.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    head.attach(target_model, tp)
    return head
