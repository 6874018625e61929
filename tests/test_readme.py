"""Every ```python block of README.md runs as written.

The blocks run in order, in one shared namespace, as a reader pasting them into one session
would: later sections continue the quick start (its ``strategy``, ``model`` and ``optimizer``).
A block that raises fails the test with the block's line number in README.md. A block that
opens with ``# NAME.py, launched with: torchrun ...`` is a script of its own: it runs under
torchrun with two processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(?P<language>[^\n`]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
LANGUAGES = {"python", "bash", "text"}
TORCHRUN = re.compile(r"^# \S+\.py, launched with: torchrun")


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
    python = [
        (code, line)
        for language, code, line in blocks()
        if language == "python" and not TORCHRUN.match(code)
    ]
    assert len(python) >= 8, "the README lost its python examples"
    namespace: dict[str, object] = {"__name__": "readme"}
    for code, line in python:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:
            error.add_note(f"in the python block at README.md line {line}")
            raise


@pytest.mark.parametrize(
    "code", [c for language, c, _ in blocks() if language == "python" and TORCHRUN.match(c)]
)
def test_torchrun_scripts_run_on_two_workers(code: str, tmp_path: Path) -> None:
    # The README says why a process that used gloo may end with os._exit after flushing.
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
