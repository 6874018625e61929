"""The fenced code blocks of the README and the guides, which the tests run as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(?P<language>[^\n`]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(document: str) -> list[tuple[str, str, int]]:
    """A file's fenced blocks (its path from the repository's root): (language, code, line
    number of the opening fence)."""
    text = (ROOT / document).read_text()
    return [
        (match["language"].strip(), match["code"], text.count("\n", 0, match.start()) + 1)
        for match in FENCE.finditer(text)
    ]


def python_blocks(document: str) -> list[tuple[str, int]]:
    """A file's python blocks: (code, line)."""
    return [(code, line) for language, code, line in blocks(document) if language == "python"]
