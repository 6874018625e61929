"""Every ```python block of docs/lightning.md runs as written (each is self-contained)."""

from __future__ import annotations

import pytest
from guides import python_blocks

pytest.importorskip("lightning")

BLOCKS = python_blocks("docs/lightning.md")


def test_the_guide_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize(("code", "line"), BLOCKS, ids=[f"line{n}" for _, n in BLOCKS])
def test_python_block_runs(code: str, line: int) -> None:
    namespace: dict[str, object] = {"__name__": "guide"}
    try:
        exec(compile(code, f"docs/lightning.md:{line}", "exec"), namespace)
    except Exception as error:
        error.add_note(f"in the python block at docs/lightning.md line {line}")
        raise
