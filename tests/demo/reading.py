"""What the demo's tests share with each other and with the command line's: reading what the
demo prints and writes, and a small slice of its data for quick runs.
"""

from __future__ import annotations

import os
import re

from centralstore.demo import job

# One intra-op thread per subprocess: pytest-xdist already runs a worker per core, and more
# threads would oversubscribe the cores, where OpenMP's spin-waiting costs 10x or more.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "centralstore_version",
    "torch_version",
    "strategy",
    "compute_devices",
    "parameter_device",
    "num_replicas_in_sync",
    "num_workers",
    "dataset",
    "train_samples",
    "test_samples",
    "epochs",
    "global_batch_size",
    "seed",
    "optimizer",
    "history",
    "test_accuracy",
    "warm_up_epochs",
    "train_seconds",
    "epoch_seconds",
    "samples_per_second",
    "steady_samples_per_second",
    "one_device",
    "one_device_in_slices",
    "max_abs_weight_difference",
    "resumed_from",
    "wall_seconds",
}


def field(stdout: str, label: str) -> str:
    """The value of a ``label: value`` line of the demo's report."""
    match = re.search(rf"^{re.escape(label)}\s*: (.+)$", stdout, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{stdout}"
    return match[1]


def rate(stdout: str, label: str) -> float:
    """The steady-state samples per second of a speed line (``  2 replicas : 11,342 (...)``)."""
    return float(field(stdout, label).split()[0].replace(",", ""))


def weight_difference(stdout: str) -> float:
    """The ``max |replicas - one device|`` of the report's weight difference line."""
    match = re.search(r"max \|replicas - one device\| = (\S+)", field(stdout, "weight difference"))
    assert match is not None
    return float(match[1])


def small_digits(train: int, test: int) -> job.Digits:
    """The first ``train`` training and ``test`` test examples of the demo's split: a few
    steps' worth, for runs of several epochs in a fraction of a second."""
    data = job.load_digits(seed=0)
    return job.Digits(
        data.train_images[:train],
        data.train_labels[:train],
        data.test_images[:test],
        data.test_labels[:test],
    )
