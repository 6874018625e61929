"""Every ```python block of docs/huggingface.md runs as written, each on its own (the guide
promises self-contained blocks), in a temporary directory for the files they write."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
FENCE = re.compile(r"^```(?P<language>[^\n`]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[str, int]]:
    text = GUIDE.read_text()
    return [
        (match["code"], text.count("\n", 0, match.start()) + 1)
        for match in FENCE.finditer(text)
        if match["language"].strip() == "python"
    ]


def test_the_guide_has_examples() -> None:
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize(
    ("code", "line"), python_blocks(), ids=[f"line{line}" for _, line in python_blocks()]
)
def test_python_block_runs(
    code: str, line: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(code, f"docs/huggingface.md:{line}", "exec"), {"__name__": "guide"})
    except Exception as error:
        error.add_note(f"in the python block at docs/huggingface.md line {line}")
        raise
