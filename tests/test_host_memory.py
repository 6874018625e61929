"""``keep_host_memory``: glibc keeps the memory freed tensors leave (``_host_memory.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import centralstore as cs
from centralstore import _host_memory

# A 48 MiB tensor made and freed eight times: glibc maps a block over 32 MiB afresh each
# time unless its settings keep it; the page faults of the last four (kept, the heap grows
# to hold the block in two of the first three, whichever).
_ALLOCATE = textwrap.dedent("""
    import resource, sys
    import torch
    import centralstore as cs

    if sys.argv[1] == "keep":
        assert cs.keep_host_memory()
    faults = 0
    for i in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.ones(12 * 2**20)  # 48 MiB, every page written
        del block
        if i >= 4:
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
""")


def _faults(setting: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _ALLOCATE, setting], capture_output=True, text=True, check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(_host_memory._mallopt() is None, reason="the C library has no mallopt")
def test_a_freed_block_is_kept_for_the_next_tensor() -> None:
    default, kept = _faults("default"), _faults("keep")
    assert default > 4 * 12 * 2**20 * 4 // 4096 // 2  # most of the four blocks' pages
    assert kept < default // 20


def test_the_thresholds_reach_the_c_library(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    def mallopt(parameter: int, value: int) -> int:
        calls.append((parameter, value))
        return 1

    monkeypatch.setattr(_host_memory, "_mallopt", lambda: mallopt)
    assert cs.keep_host_memory(256)
    assert calls == [(-3, 256 * 2**20), (-1, 512 * 2**20)]
    calls.clear()
    assert cs.keep_host_memory()  # 1 GiB blocks: the trim threshold stops at a C int's limit
    assert calls == [(-3, 2**30), (-1, 2**31 - 1)]


def test_a_refused_setting_reads_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_host_memory, "_mallopt", lambda: lambda parameter, value: 0)
    assert cs.keep_host_memory() is False


def test_without_mallopt_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_host_memory, "_mallopt", lambda: None)
    assert cs.keep_host_memory() is False


@pytest.mark.parametrize("size", [0, -1, 2048, 1.5, True, "1024"])
def test_a_size_out_of_range_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match=r"max_block_mb must be a whole number of MiB from 1 to"):
        cs.keep_host_memory(size)  # type: ignore[arg-type]
