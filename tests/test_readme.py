"""Every ```python block of README.md runs as written.

The blocks run in order, in one shared namespace, as a reader pasting them into one session
would: later sections continue the quick start (its ``strategy``, ``model`` and ``optimizer``).
A block that raises fails the test with the block's line number in README.md.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(?P<language>[^\n`]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
LANGUAGES = {"python", "bash", "text"}


def blocks() -> list[tuple[str, str, int]]:
    """The README's fenced blocks: (language, code, line number of the opening fence)."""
    text = README.read_text()
    return [
        (match["language"].strip(), match["code"], text.count("\n", 0, match.start()) + 1)
        for match in FENCE.finditer(text)
    ]


def test_every_block_names_its_language() -> None:
    unmarked = [(language, line) for language, _, line in blocks() if language not in LANGUAGES]
    assert not unmarked, f"README.md blocks need one of {sorted(LANGUAGES)}: {unmarked}"


def test_python_blocks_run_in_order_in_one_namespace() -> None:
    python = [(code, line) for language, code, line in blocks() if language == "python"]
    assert len(python) >= 8, "the README lost its python examples"
    namespace: dict[str, object] = {"__name__": "readme"}
    for code, line in python:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:
            error.add_note(f"in the python block at README.md line {line}")
            raise
