"""Every ```python block of docs/huggingface.md runs as written, each on its own (the guide
promises self-contained blocks), in a temporary directory for the files they write."""

from __future__ import annotations

from pathlib import Path

import pytest
from guides import python_blocks

BLOCKS = python_blocks("docs/huggingface.md")


def test_the_guide_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize(
    ("code", "line"), BLOCKS, ids=[f"line{line}" for _, line in BLOCKS]
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
