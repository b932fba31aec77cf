"""Tiny random-weight Hugging Face checkpoints for tests, built with transformers.

Every folder has a real byte-level BPE tokenizer (trained here on a few sentences)
with a chat template, so the same folder exercises tandem's loader, tokenizer and
model against transformers.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] | trim }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] | trim }}\n"
    "{% else %}<|assistant|>{{ message['content'] | trim }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks with a block table.",
    "Prefill is compute-bound; decode is memory-bandwidth-bound. Ça va, naïve café 東京",
    "def forward(self, input_ids, positions):\n    return self.model(input_ids)",
] * 20

ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe",
    "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe",
    "granite_hybrid", "gemma4", "gemma4_moe",
)  # fmt: skip

# Qwen3.5's Gated DeltaNet layers (and its attention's head size): value heads twice the
# key heads; head_dim * heads != hidden.
DELTA_NET = dict(
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )


def hf_config(arch: str, **overrides):
    common = dict(vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=1)
    llama_like = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **common,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**llama_like, **overrides})
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**llama_like, "sliding_window": 24, **overrides})
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**llama_like, **overrides})
    elif arch == "qwen3":
        # head_dim * heads != hidden: the explicit head_dim must be honoured.
        cfg = transformers.Qwen3Config(**{**llama_like, "head_dim": 32, **overrides})
    elif arch == "qwen3_moe":
        # 6 experts, 2 a token, renormalized; the middle layer dense (mlp_only_layers).
        moe = dict(
            llama_like, head_dim=32, num_hidden_layers=3, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
        cfg = transformers.Qwen3MoeConfig(**{**moe, **overrides})
    elif arch == "qwen2_moe":
        # 4 experts, 2 a token, not renormalized (the family's default), and a shared
        # expert; every second layer sparse (decoder_sparse_step).
        moe = dict(
            llama_like, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=48, shared_expert_intermediate_size=80, decoder_sparse_step=2,
        )  # fmt: skip
        cfg = transformers.Qwen2MoeConfig(**{**moe, **overrides})
    elif arch == "mixtral":
        moe = dict(llama_like, num_local_experts=4, num_experts_per_tok=2, intermediate_size=96)
        cfg = transformers.MixtralConfig(**{**moe, **overrides})
    elif arch == "gemma3":
        # Local layers slide over 8 tokens (prompts are longer), with their own rotary
        # base; head_dim * heads != hidden and the score scale is not head_dim's.
        gemma = dict(
            llama_like,
            head_dim=32,
            num_hidden_layers=3,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            pad_token_id=2,
        )
        cfg = transformers.Gemma3TextConfig(**{**gemma, **overrides})
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif arch in ("gemma4", "gemma4_moe"):
        # Gemma 4: sliding layers over 8 tokens with heads of 16, full ones with heads of
        # 32 turned by proportional rope, a KV head whose values are its keys; logits
        # soft-capped. gemma4 (E2B's kind): the last two layers read layers 1's and 2's
        # K/V and have MLPs twice as wide; per-layer inputs of 8. gemma4_moe (26B-A4B's
        # kind): no per-layer inputs nor shared layers; in every layer a mixture of 6
        # experts of 48, 2 a token, beside the MLP.
        gemma = dict(
            llama_like, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
            pad_token_id=2,
        )  # fmt: skip
        if arch == "gemma4":
            gemma.update(
                num_hidden_layers=5, num_kv_shared_layers=2, use_double_wide_mlp=True,
                layer_types=["sliding_attention", "sliding_attention", "full_attention",
                             "sliding_attention", "full_attention"],
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE,
            )  # fmt: skip
        else:
            gemma.update(
                num_hidden_layers=3, hidden_size_per_layer_input=0, enable_moe_block=True,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                num_experts=6, top_k_experts=2, moe_intermediate_size=48,
            )  # fmt: skip
        cfg = transformers.Gemma4TextConfig(**{**gemma, **overrides})
        cfg.architectures = ["Gemma4ForCausalLM"]
    elif arch == "gpt_oss":
        # Sliding layers (0 and 2) over 8 tokens, YaRN over 64 positions, 6 experts
        # with 2 a token; head_dim * heads != hidden.
        oss = dict(
            llama_like, head_dim=32, num_hidden_layers=3, num_local_experts=6,
            num_experts_per_tok=2, intermediate_size=48, sliding_window=8,
            rope_parameters={
                "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        )  # fmt: skip
        cfg = transformers.GptOssConfig(**{**oss, **overrides})
    elif arch == "qwen3_5":
        # Gated DeltaNet layers around two gated-attention ones (each keeps K/V), value
        # heads twice the key heads; head_dim * heads != hidden, a quarter of it rotated.
        hybrid = dict(
            llama_like, **DELTA_NET, num_hidden_layers=5,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "linear_attention", "full_attention"],
        )  # fmt: skip
        cfg = transformers.Qwen3_5TextConfig(**{**hybrid, **overrides})
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif arch == "qwen3_5_moe":
        # Qwen3.5's layers with a mixture in each: 6 experts, 2 a token, and a shared one.
        hybrid = dict(
            llama_like, **DELTA_NET, num_hidden_layers=4, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        )  # fmt: skip
        cfg = transformers.Qwen3_5MoeTextConfig(**{**hybrid, **overrides})
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    elif arch == "qwen3_next":
        # Qwen3.5-MoE's layers, the delta nets' projections interleaved per key head; the
        # third layer's MLP dense (mlp_only_layers).
        hybrid = dict(
            llama_like, **DELTA_NET, num_hidden_layers=4, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
            mlp_only_layers=[2],
        )  # fmt: skip
        cfg = transformers.Qwen3NextConfig(**{**hybrid, **overrides})
        cfg.architectures = ["Qwen3NextForCausalLM"]
    elif arch == "lfm2_moe":
        # LFM2's layers, the first MLP dense, the others 6 experts with 2 a token routed
        # by sigmoid scores and a selection bias (perturbed below as a bias).
        hybrid = dict(
            llama_like, num_hidden_layers=4, num_dense_layers=1, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=48, tie_word_embeddings=False,
            layer_types=["conv", "full_attention", "conv", "conv"], routed_scaling_factor=1.5,
        )  # fmt: skip
        cfg = transformers.Lfm2MoeConfig(**{**hybrid, **overrides})
        cfg.architectures = ["Lfm2MoeForCausalLM"]
    elif arch == "granite_hybrid":
        # Granite 4.0-H: Mamba-2 layers (8 heads of 16, 2 groups of B and C, a state of
        # 16) around an attention one without rotary; 4 experts, 2 a token, beside the
        # shared MLP; Granite's four multipliers away from 1.
        hybrid = dict(
            llama_like, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
            shared_intermediate_size=80, position_embedding_type="nope",
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
            logits_scaling=1.5,
        )  # fmt: skip
        cfg = transformers.GraniteMoeHybridConfig(**{**hybrid, **overrides})
        cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    elif arch == "lfm2":
        # Convolution layers around two attention ones (each keeps K/V); the MLP's width
        # adjusted as LFM2's code does (2/3 of 128, rounded up to 32: 96). Untied (the
        # family's default is tied): a tied random model repeats its input token, which
        # leaves speculation nothing to reject.
        hybrid = dict(
            llama_like, num_hidden_layers=5, block_multiple_of=32, tie_word_embeddings=False,
            layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        )  # fmt: skip
        cfg = transformers.Lfm2Config(**{**hybrid, **overrides})
        cfg.architectures = ["Lfm2ForCausalLM"]
    elif arch == "gpt2":
        gpt2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
        cfg = transformers.GPT2Config(**{**gpt2, **overrides})
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    return cfg


def save_model(
    folder: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> transformers.PreTrainedModel:
    """Save a random-weight model (and tokenizer) to ``folder``; returns the HF model."""
    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so a loader that
    # skipped one would be caught. Attention sinks (gpt-oss) as large as the scores.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            if name.endswith(("router.scale", "per_expert_scale")):  # (Gemma 4's, 1 at init)
                param.copy_(1 + torch.randn_like(param) * 0.3)
        for name, buffer in model.named_buffers():  # (LFM2-MoE's selection bias)
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.3)
            if name.endswith("layer_scalar"):  # (Gemma 4's, 1 at init)
                buffer.copy_(1 + torch.randn_like(buffer) * 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    build_tokenizer().save_pretrained(folder)
    return model


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for one sequence, float32."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def reference_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop), one at a time."""
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            results.append(out[0, len(ids) :].tolist())
    return results


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs difference within ``rel`` of the reference logits' scale."""
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max abs diff {err:.3g} vs logits scale {scale:.3g}"


def from_gguf(path: Path, with_tokenizer: bool = False):
    """transformers' model of a GGUF file (float32, eval), and its tokenizer if asked
    (then a pair). transformers parses the file's metadata with gguf's GGUFReader for
    the config, the weights and the tokenizer, each time: some 25 s a parse on a 2-core
    VM for Gemma 3's 262,144-token vocabulary. One reader serves all of them here, over
    the file read into memory rather than mapped: the parse slices the data once per
    value (a million times for that vocabulary), and a memmap's slices are 3x slower
    to make than an array's (19 s against 6 s for that file). transformers then turns
    every value of the metadata into Python once per pass over it (the config, the
    weights and the tokenizer each make one): the one reader's values are turned once
    and kept by the identity of their parts, which the reader keeps alive; and the map of
    tensor names it builds for each of the model's 300 modules is built once."""
    import gguf
    import numpy as np
    import pytest
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parse = gguf.GGUFReader
    parse_value = gguf_utils._gguf_parse_value

    def read(path):
        with pytest.MonkeyPatch.context() as patch:  # (the reader maps the file itself)
            patch.setattr(np, "memmap", lambda file, mode="r": np.fromfile(file, np.uint8))
            return parse(path)

    values: dict[int, tuple] = {}

    def value(part, types):
        if id(part) not in values:  # (the part is kept beside its value: ids stay unique)
            text = types[-1] == 8  # a string's bytes, which transformers copies a byte at a time
            values[id(part)] = (part, part.tobytes().decode() if text else parse_value(part, types))
        return values[id(part)][1]

    reader = functools.cache(read)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf_utils, "_gguf_parse_value", value)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        if not with_tokenizer:
            return model
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert reader.cache_info().misses == 1  # (one parse)
    return model, tokenizer


ENCODERS = ("bert", "xlm_roberta")


def save_encoder(folder: Path, arch: str, num_labels: int = 0, seed: int = 0):
    """A random-weight encoder (``bert``, ``xlm_roberta`` or ``modernbert``; with a
    classification head of ``num_labels`` outputs: a cross-encoder) and a tokenizer
    that joins a pair as the family's does (BERT: ``<s> a </s> b </s>``, the second
    text of type 1; RoBERTa: ``<s> a </s></s> b </s>``, one type; ModernBERT: BERT's
    without types); returns the HF model. ModernBERT's local layers see 4 tokens on
    either side (prompts are longer); with 3 labels its head reads the mean."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    if arch == "bert":
        config = transformers.BertConfig(**shape, type_vocab_size=2, pad_token_id=2)
    elif arch == "modernbert":
        config = transformers.ModernBertConfig(
            **{**shape, "num_hidden_layers": 4}, local_attention=8, global_attn_every_n_layers=3,
            global_rope_theta=1000.0, pad_token_id=2, bos_token_id=0, eos_token_id=1,
            cls_token_id=0, sep_token_id=1, norm_bias=True, attention_bias=True,
            classifier_pooling="mean" if num_labels == 3 else "cls",
        )  # fmt: skip
    else:  # a pad id no prompt holds: RoBERTa's positions skip the pad id's tokens
        config = transformers.XLMRobertaConfig(**shape, type_vocab_size=1, pad_token_id=2)
    config._attn_implementation = "eager"
    if num_labels:
        config.num_labels = num_labels
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    else:
        model = transformers.AutoModel.from_config(config)
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    backend = build_tokenizer().backend_tokenizer
    pair = {"bert": "<s> $A </s> $B:1 </s>:1", "modernbert": "<s> $A </s> $B </s>"}.get(
        arch, "<s> $A </s> </s> $B </s>"
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair=pair, special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<|system|>",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )  # fmt: skip
    tok.save_pretrained(folder)
    return model
