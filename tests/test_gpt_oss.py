"""gpt-oss beyond the shared family tests (test_models_match_hf, test_gguf): OpenAI's
MXFP4 checkpoints (the experts as ``_blocks`` and ``_scales``) against transformers on
the float weights they hold, decoded by OpenAI's definition; the config's defaults;
what llama.cpp's gpt-oss cannot hold is refused on export."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tandem.errors import ModelLoadError
from tandem.models.gguf_export import export_gguf
from tandem.models.gguf_file import GGUFFile
from tandem.models.gpt_oss import parse_gpt_oss_config
from tandem.models.loader import load_model
from tandem.models.quantized import packed_parts
from tandem.models.random_gguf import Shape, write_random_gguf
from tandem.quant.blocks import GGMLType, dequantize
from tandem.runner.model_runner import ModelRunner, SequenceChunk
from tests.hf_models import VOCAB_SIZE, assert_close, reference_logits, save_model

# OpenAI's E2M1 values (gpt_oss's FP4_VALUES): a nibble q is FP4[q] * 2**(e - 127).
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip


def to_openai_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (blocks uint8 [..., out, in/32, 16], scales uint8
    [..., out, in/32]): each block of 32 under the exponent that puts its largest
    value within 6, each value its nearest E2M1 number; byte j holds values 2j (low
    nibble) and 2j + 1 (high)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    largest = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    q = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    blocks = q[..., 0::2] | (q[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def from_openai_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's definition, written out: the inverse of the layout above."""
    q = torch.stack((blocks & 0x0F, blocks >> 4), -1).flatten(-2).long()
    values = FP4[q] * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)


# A small config.json as OpenAI's name some keys (experts_per_token).
SMALL = {"architectures": ["GptOssForCausalLM"], "vocab_size": 100, "hidden_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
         "experts_per_token": 2}  # fmt: skip


@pytest.fixture(scope="module")
def mxfp4_folders(tmp_path_factory):
    """(a folder as OpenAI's files are: experts in MXFP4, the rest float; the same model
    in float, its experts the MXFP4 values decoded) from one random model."""
    float_folder = tmp_path_factory.mktemp("oss-float")
    save_model(float_folder, "gpt_oss", hidden_size=128, intermediate_size=64)
    weights = load_file(float_folder / "model.safetensors")
    quantized = {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = to_openai_mxfp4(tensor.transpose(1, 2))  # [E, out, in]
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            weights[name] = from_openai_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            quantized[name] = tensor
    save_file(weights, float_folder / "model.safetensors", metadata={"format": "pt"})
    mxfp4_folder = tmp_path_factory.mktemp("oss-mxfp4")
    for path in float_folder.iterdir():
        if path.name != "model.safetensors":
            (mxfp4_folder / path.name).write_bytes(path.read_bytes())
    save_file(quantized, mxfp4_folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (mxfp4_folder / "config.json").write_text(json.dumps(config))
    return mxfp4_folder, float_folder


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_openai_mxfp4_experts_equal_transformers_on_their_values(mxfp4_folders, quantization):
    """The experts' nibbles moved into GGML's blocks, not decoded: decoded ("none") the
    model equals transformers on the float values OpenAI's definition gives; kept in
    MXFP4 ("auto", the kernels) the same up to the int8 activations."""
    mxfp4_folder, float_folder = mxfp4_folders
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_folder).eval()
    loaded = load_model(mxfp4_folder, quantization=quantization)
    expert = loaded.model.model.layers[0].mlp.experts["0"].gate_up_proj
    assert (getattr(expert, "packed_parts", None) is not None) == (quantization == "auto")
    ids = [random.Random(4).randrange(VOCAB_SIZE) for _ in range(40)]
    runner = ModelRunner(loaded, 8, 16)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2])], all_logits=True)
    expected = reference_logits(hf, ids)
    if quantization == "none":
        assert_close(ours, expected)
    else:
        assert (ours - expected).abs().max() < 0.05 * expected.abs().max()
        assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_an_mxfp4_folder_exports_as_the_same_model(mxfp4_folders, tmp_path):
    """`tandem quantize` of an OpenAI folder: the experts' MXFP4 blocks as read."""
    mxfp4_folder, float_folder = mxfp4_folders
    path = export_gguf(mxfp4_folder, tmp_path / "model.gguf", "f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(float_folder).eval()
    loaded = load_model(path, quantization="none")
    ids = list(range(3, 30))
    ours = ModelRunner(loaded, 8, 16).forward([SequenceChunk(ids, 0, [0, 1])], all_logits=True)
    assert_close(ours, reference_logits(hf, ids))


def test_a_config_without_rotary_or_layer_types_takes_transformers_defaults():
    raw = SMALL
    config = parse_gpt_oss_config(raw)
    theirs = transformers.GptOssConfig(**{k: v for k, v in raw.items() if k != "experts_per_token"},
                                     num_experts_per_tok=2)  # fmt: skip
    assert config.layer_windows() == tuple(
        128 if kind == "sliding_attention" else None for kind in theirs.layer_types
    )
    rope = theirs.rope_parameters
    assert config.rope.scaling_type == rope["rope_type"] == "yarn"
    assert config.rope.theta == rope["rope_theta"] == 150000.0
    assert config.rope.scaling["factor"] == rope["factor"]
    assert config.moe.top_k == 2 and config.moe.router_bias and config.moe.expert_bias


def test_a_layout_llama_cpp_cannot_hold_is_refused_on_export(tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    save_model(folder, "gpt_oss", layer_types=["full_attention"] * 3)
    with pytest.raises(ModelLoadError, match="even layers sliding"):
        export_gguf(folder, tmp_path / "odd.gguf", "f32")


def test_the_whole_layer_decode_leaves_a_layer_with_sinks_to_its_calls():
    """The compiled whole-layer decode has no sinks: it declines gpt-oss's layers (their
    experts still take their one call: tests/test_moe.py)."""
    from tandem.models.gpt_oss import GptOssDecoderLayer
    from tandem.runner.fused_decode import layer_arguments

    config = parse_gpt_oss_config({**SMALL, "num_hidden_layers": 2})
    layer = GptOssDecoderLayer(config, 0)
    assert layer.mlp.experts["0"].swiglu == (1.702, 7.0)
    assert layer_arguments(layer) is None


def test_a_random_file_of_the_20b_layout_loads_every_expert_in_its_bits(tmp_path):
    """write_random_gguf's gpt-oss (the benchmarks' 20b, here narrow): experts MXFP4
    (llama-quantize's MXFP4_MOE: the rest Q8_0), stacked biases read one expert at a
    time; every expert holds the weights dequantizing its rows of the stack gives."""
    shape = Shape(256, 4, 4, 2, 256, tied=False, vocab=512, architecture="gpt-oss",
                  head_size=64, experts=6, experts_used=2, expert_intermediate=256)  # fmt: skip
    path = write_random_gguf(tmp_path / "oss.gguf", shape, "mxfp4")
    file = GGUFFile(path)
    infos = {info.name: info for info in file.tensors}
    assert GGMLType(infos["blk.0.ffn_up_exps.weight"].type) == GGMLType.MXFP4
    assert GGMLType(infos["blk.0.attn_q.weight"].type) == GGMLType.Q8_0
    assert list(infos["blk.0.ffn_gate_exps.bias"].shape) == [256, 6]
    loaded = load_model(path, load_tokenizer=False)
    assert loaded.config.layer_windows() == (128, None, 128, None)
    layer = loaded.model.model.layers[1].mlp
    info = infos["blk.1.ffn_down_exps.weight"]
    stack = torch.from_numpy(file.data(info).reshape(6 * 256, -1).copy())
    whole = dequantize(GGMLType.MXFP4, stack, 256)
    for expert in range(6):
        ((_, part),) = packed_parts(layer.experts[str(expert)].down_proj)
        assert torch.equal(part.dequantize(), whole[expert * 256 : (expert + 1) * 256])
        assert torch.equal(layer.experts[str(expert)].down_proj.bias, torch.ones(256))
    file.close()
    ids = list(range(3, 20))
    logits = ModelRunner(loaded, 4, 16).forward([SequenceChunk(ids, 0, [0, 1])], all_logits=True)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["split-experts", "whole-experts"])
def test_an_mxfp4_folder_on_two_ranks_gives_one_processs_tokens(mxfp4_folders, expert_parallel):
    """The MXFP4 experts cut on their own 32-weight blocks (each rank its columns of
    every expert), or whole experts a rank; the sinks with their heads."""
    from tandem import LLM, SamplingParams

    mxfp4_folder, _ = mxfp4_folders
    prompts = [{"prompt_token_ids": [random.Random(s).randrange(VOCAB_SIZE) for _ in range(n)]}
               for s, n in ((1, 9), (2, 17))]  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one = LLM(str(mxfp4_folder), max_num_seqs=2)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(str(mxfp4_folder), max_num_seqs=2, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel)  # fmt: skip
    try:
        ours = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    finally:
        two.engine.executor.close()
    assert ours == expected


def test_a_gguf_files_harmony_ends_stop_generation_and_o200k_splits_as_its_tokenizer(tmp_path):
    """A file states one EOS; harmony's <|return|> and <|call|> end a generation too
    (llama.cpp's EOG list). gpt-4o's pre-tokenizer (o200k): words cut at case
    changes with their contractions, digits in threes, punctuation before a letter
    kept with it."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from tandem.models.gguf_tokenizer import SPLIT_REGEX

    folder = tmp_path / "oss"
    folder.mkdir()
    save_model(folder, "gpt_oss")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                "<|return|>", "<|call|>"])  # fmt: skip
    backend.save(str(folder / "tokenizer.json"))
    path = export_gguf(folder, tmp_path / "oss.gguf", "f32")
    loaded = load_model(path)
    ends = [loaded.tokenizer.encode(t, False)[0] for t in ("<|return|>", "<|call|>")]
    assert set(ends) <= set(loaded.eos_token_ids)
    assert loaded.tokenizer.encode("<|end|>", False)[0] not in loaded.eos_token_ids

    split = pre_tokenizers.Split(Regex(SPLIT_REGEX["gpt-4o"]), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("HelloWorld's CamelCASEWord 1234567 a/b\n\n x")]
    assert pieces == ["Hello", "World's", " Camel", "CASEWord", " ", "123", "456", "7", " a",
                      "/b", "\n\n", " x"]  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=16, block_size=5, num_blocks=14),  # chunks, preemption
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "disable_by_batch_size": None}),  # verification rows
    ],
    ids=["chunked-preempted", "ngram-speculation"],
)  # fmt: skip
def test_the_engine_gives_transformers_greedy_tokens(model_dirs, options):
    """Through the whole engine (sliding layers over 8 tokens, sinks, the mixture):
    prompts cut into chunks under a budget that forces preemption, or decoded with
    n-gram drafts verified as rows of the paged kernel, give transformers' tokens."""
    from tandem import LLM, SamplingParams
    from tests.hf_models import reference_greedy

    folder, hf_model = model_dirs("gpt_oss")
    rng = random.Random(11)
    motif = [rng.randrange(VOCAB_SIZE) for _ in range(5)]
    prompts = [motif * 4 + [rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (3, 17, 9)]
    llm = LLM(str(folder), **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy(hf_model, prompts, 12)
    if "num_blocks" in options:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    else:
        assert llm.engine.spec_stats.num_drafts > 0
    llm.engine.kv_manager.check_no_leaks()
