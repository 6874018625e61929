"""Every ```python block of README.md and of the guides in docs/ runs as written.

Each file's blocks run in order, in one namespace of that file, as a reader pasting them into
one session would: later sections of README.md continue its quick start (its ``strategy``,
``model`` and ``optimizer``), and each guide opens with the session its examples continue.
Every block is a test of its own (``test_python_block_runs[docs/porting.md:120]``); a block
runs after the blocks before it in its file, which run first where this process has not run
them yet (under pytest-xdist, or with ``-k``). A block that raises fails its test with its
file and line number. A block that opens with ``# NAME.py, launched with: torchrun ...`` is a
script of its own: it runs under torchrun with two processes.

docs/lightning.md and docs/huggingface.md have tests of their own
(tests/lightning/test_guide.py, tests/transformers/test_guide.py); docs/design.md's blocks are
illustrations, not run. Every relative link of these files points at a file that exists, and
at a heading of it where it names one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from guides import FENCE, blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The guides whose blocks are run elsewhere, or not at all.
NOT_RUN_HERE = {
    "docs/lightning.md": "tests/lightning/test_guide.py",
    "docs/huggingface.md": "tests/transformers/test_guide.py",
    "docs/design.md": "the design note: its blocks are illustrations",
}
GUIDES = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md"))
DOCUMENTS = ["README.md", *(guide for guide in GUIDES if guide not in NOT_RUN_HERE)]
LANGUAGES = {"python", "bash", "text"}
TORCHRUN = re.compile(r"^# \S+\.py, launched with: torchrun")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def python_blocks(document: str) -> list[tuple[str, int]]:
    """A file's python blocks that run in its namespace: (code, line)."""
    return [
        (code, line)
        for language, code, line in blocks(document)
        if language == "python" and not TORCHRUN.match(code)
    ]


PYTHON = [(document, line) for document in DOCUMENTS for _, line in python_blocks(document)]
SCRIPTS = [
    (document, line)
    for document in DOCUMENTS
    for language, code, line in blocks(document)
    if language == "python" and TORCHRUN.match(code)
]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_block_names_its_language(document: str) -> None:
    unmarked = [(lang, line) for lang, _, line in blocks(document) if lang not in LANGUAGES]
    assert not unmarked, f"{document} blocks need one of {sorted(LANGUAGES)}: {unmarked}"


def test_readme_and_guides_keep_their_examples() -> None:
    counts = {document: len(python_blocks(document)) for document in DOCUMENTS}
    assert counts["README.md"] >= 5, "the README lost its python examples"
    assert counts["docs/porting.md"] >= 8 and counts["docs/keras.md"] >= 4, counts
    assert len(SCRIPTS) >= 1, "the multi-worker guide lost its torchrun script"


# Per file: its namespace and how many of its blocks have run in it.
_sessions: dict[str, tuple[dict[str, object], int]] = {}


def _exec(document: str, code: str, line: int, namespace: dict[str, object]) -> None:
    try:
        exec(compile(code, f"{document}:{line}", "exec"), namespace)
    except Exception as error:
        error.add_note(f"in the python block at {document} line {line}")
        raise


@pytest.mark.parametrize(("document", "line"), PYTHON, ids=[f"{d}:{n}" for d, n in PYTHON])
def test_python_block_runs(document: str, line: int) -> None:
    ordered = python_blocks(document)
    index = [n for _, n in ordered].index(line)
    namespace, done = _sessions.get(document, ({}, 0))
    if done > index:  # run again (or out of order): a fresh session
        namespace, done = {}, 0
    namespace.setdefault("__name__", "readme")
    _sessions.pop(document, None)  # a block that fails leaves no half-run session behind
    for code, earlier in ordered[done:index]:
        _exec(document, code, earlier, namespace)
    _exec(document, ordered[index][0], line, namespace)
    _sessions[document] = (namespace, index + 1)


@pytest.mark.parametrize(("document", "line"), SCRIPTS, ids=[f"{d}:{n}" for d, n in SCRIPTS])
def test_torchrun_scripts_run_on_two_workers(document: str, line: int, tmp_path: Path) -> None:
    # docs/multi-worker.md says why a process that used gloo may end with os._exit after
    # flushing.
    (code,) = [c for _, c, n in blocks(document) if n == line]
    script = tmp_path / "script.py"
    script.write_text(code + "\nimport os, sys\nsys.stdout.flush()\nos._exit(0)\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.strip()]
    assert printed and all(float(line) > 0 for line in printed)  # the chief's losses only


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (fenced blocks left out)."""
    text = FENCE.sub("", path.read_text())
    headings = re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(document: str) -> None:
    source = ROOT / document
    text = FENCE.sub("", source.read_text())
    broken = []
    for match in LINK.finditer(text):
        target = match["target"]
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        path = (source.parent / name).resolve() if name else source
        if not path.exists() or (anchor and (path.suffix != ".md" or anchor not in anchors(path))):
            broken.append(target)
    assert not broken, f"{document}: links to nothing: {broken}"


def test_the_guides_not_run_here_have_their_own_tests() -> None:
    for guide, runner in NOT_RUN_HERE.items():
        assert (ROOT / guide).exists(), guide
        assert runner.startswith("the design") or (ROOT / runner).exists(), runner
