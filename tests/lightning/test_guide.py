"""Every ```python block of docs/lightning.md runs as written (each is self-contained)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("lightning")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "lightning.md"
FENCE = re.compile(r"^```(?P<language>[^\n`]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, int]]:
    text = GUIDE.read_text()
    return [
        (match["code"], text.count("\n", 0, match.start()) + 1)
        for match in FENCE.finditer(text)
        if match["language"].strip() == "python"
    ]


def test_the_guide_has_examples() -> None:
    assert len(blocks()) >= 3


@pytest.mark.parametrize(("code", "line"), blocks(), ids=[f"line{n}" for _, n in blocks()])
def test_python_block_runs(code: str, line: int) -> None:
    namespace: dict[str, object] = {"__name__": "guide"}
    try:
        exec(compile(code, f"docs/lightning.md:{line}", "exec"), namespace)
    except Exception as error:
        error.add_note(f"in the python block at docs/lightning.md line {line}")
        raise
