"""`tandem generate` and `tandem quantize` as a user runs them: a real process."""

from __future__ import annotations

import subprocess
import sys

from tandem import LLM, SamplingParams


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_streams_the_engine_output(model_dirs):
    folder, _ = model_dirs("llama")
    result = run_cli(
        "generate",
        "--model",
        str(folder),
        "The quick brown",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    )
    assert result.returncode == 0, result.stderr
    expected = LLM(str(folder)).generate(
        "The quick brown", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )[0]
    assert result.stdout == expected.outputs[0].text + "\n"
    assert "TTFT" in result.stderr and "TPOT" in result.stderr and "tokens/s" in result.stderr


def test_errors_are_one_line(model_dirs, tmp_path):
    folder, _ = model_dirs("llama")
    cases = [
        (["--model", str(tmp_path / "missing"), "hi"], "does not exist"),
        (["--model", str(folder), "hi", "--temperature", "-1"], "temperature"),
        (["--model", str(folder), "hi", "--max-tokens", "100000"], "max_model_len"),
        (["--model", str(folder), "hi", "--scheduling-policy", "nope"], "scheduling_policy"),
        # a speculative setting without a method is an error, not silently dropped
        (["--model", str(folder), "hi", "--num-speculative-tokens", "3"], "--speculative-method"),
        (["--model", str(folder), "hi", "--device", "tpu"], "device 'tpu' is not supported"),
        (["--model", str(folder), "hi", "--threads", "-1"], "--threads"),
    ]
    for args, message in cases:
        result = run_cli("generate", *args)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr


def test_serve_and_bench_errors_are_one_line(tiny_server, tmp_path):
    """A busy port fails before the model loads; a bad --tokenizer names itself."""
    busy = tiny_server.rsplit(":", 1)[1]
    result = run_cli("serve", "--port", busy)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "cannot listen" in lines[0], lines
    result = run_cli(
        "bench", "serve", "--base-url", tiny_server, "--model", "tiny",
        "--tokenizer", str(tmp_path), "--num-prompts", "1",
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--tokenizer" in lines[0], lines


def test_quantize_writes_a_gguf_file_generate_runs(model_dirs, tmp_path):
    """`tandem quantize` then `tandem generate --model file.gguf`: the quantized model
    answers as the engine does on the same file (weights kept in Q4_0)."""
    folder, _ = model_dirs("llama")
    out = tmp_path / "model-q4_0.gguf"
    result = run_cli("quantize", str(folder), str(out), "--type", "q4_0")
    assert result.returncode == 0, result.stderr
    assert out.is_file() and "q4_0" in result.stdout
    result = run_cli(
        "generate", "--model", str(out), "The quick brown", "--max-tokens", "6",
        "--temperature", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    llm = LLM(str(out))
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.packed_parts
    expected = llm.generate(
        "The quick brown", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )[0]
    assert result.stdout == expected.outputs[0].text + "\n"


def test_generate_uses_the_bundled_model_by_default():
    result = run_cli("generate", "import os", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    llm = LLM()
    # Unset sampling flags take the model's recommended settings (generation_config).
    params = llm.get_default_sampling_params(max_tokens=8)
    assert params.repetition_penalty != 1.0
    expected = llm.generate("import os", params, use_tqdm=False)[0]
    assert result.stdout == expected.outputs[0].text + "\n"


def test_every_engine_setting_is_a_flag_with_help():
    """The engine flags are generated from the config dataclasses: each setting (every
    field that is not itself a section) has a flag, a help text and a metavar that
    reads as a value; --version answers."""
    import dataclasses

    from tandem.cli import build_parser
    from tandem.config import (
        CacheConfig,
        EngineConfig,
        KVTransferConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {s: a for a in serve._actions for s in a.option_strings}
    sections = {"model", "cache", "scheduler", "speculative", "kv_transfer"}
    configs = (EngineConfig, CacheConfig, SchedulerConfig, SpeculativeConfig, KVTransferConfig)
    settings = [f for cls in configs for f in dataclasses.fields(cls) if f.name not in sections]
    assert len(settings) == 27  # a new setting must show up here, and as a flag
    for f in settings:
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        action = actions[flag]
        assert action.help and f.metadata["help"] in action.help, flag
        assert action.metavar is None or action.metavar.isupper(), flag
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("tandem ")
    options = run_cli("generate", "--help").stdout
    assert "--max-num-batched-tokens TOKENS" in options and "(default: 2048)" in options
