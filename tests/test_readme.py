"""The README's Python examples run as written: the offline one in-process, the client
ones (OpenAI's and Anthropic's SDKs) against a real `tandem serve` of the bundled model
(its port swapped in)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem.server.launch import tandem_process

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert any("LLM(" in b for b in blocks) and any("OpenAI(" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, capsys):
    code = python_blocks()[index]
    if "OpenAI(" not in code and "Anthropic(" not in code:
        exec(compile(code, f"README.md python block {index}", "exec"), {})
        return
    with tandem_process("serve") as url:
        port = url.rsplit(":", 1)[1]
        exec(compile(code.replace(":8000", f":{port}"), "README.md client block", "exec"), {})
    assert capsys.readouterr().out  # the streamed text was printed
