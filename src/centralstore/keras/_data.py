"""``cs.Dataset`` as input to ``fit``, ``evaluate`` and ``predict``.

Keras takes a ``tf.data.Dataset`` of batches as input; the port of one is a ``cs.Dataset``,
which Keras' own adapters do not know. Each of its elements is one batch (``(x,)``,
``(x, y)`` or ``(x, y, sample_weight)``), and it reaches Keras' PyTorch trainer through a
``DataLoader`` that adds no batching. As for a ``tf.data.Dataset``, ``class_weight`` turns
each batch's targets into sample weights, and ``y`` or ``sample_weight`` passed beside the
dataset are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..input.dataset import Dataset
from ._backend import load

keras = load()
from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: E402
from keras.src.trainers.data_adapters.torch_data_loader_adapter import (  # noqa: E402
    TorchDataLoaderAdapter,
)


class _Batches(IterableDataset[Any]):
    """The batches of a ``cs.Dataset``, with ``class_weight`` applied."""

    def __init__(self, dataset: Dataset, class_weight: dict[int, float] | None) -> None:
        self._dataset = dataset
        self._class_weight = class_weight

    def __iter__(self) -> Iterator[Any]:
        for batch in self._dataset:
            if self._class_weight is None:
                yield batch
                continue
            x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
            if sample_weight is not None or y is None:
                raise ValueError(
                    "class_weight turns each batch's targets into sample weights, so the "
                    "dataset's batches must be (x, y) pairs. Received: a batch of "
                    f"{len(batch) if isinstance(batch, (tuple, list)) else 1} part(s)"
                )
            weights = data_adapter_utils.class_weight_to_sample_weights(y, self._class_weight)
            yield x, y, torch.from_numpy(weights)


class _SizedBatches(_Batches):
    """``_Batches`` of a dataset whose number of batches is known (Keras' progress bar and
    ``steps_per_epoch`` defaults read it)."""

    def __len__(self) -> int:
        return len(self._dataset)


def adapter(
    dataset: Dataset,
    y: Any = None,
    sample_weight: Any = None,
    class_weight: dict[int, float] | None = None,
) -> Any:
    """A Keras data adapter over the batches of ``dataset``."""
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise ValueError(
                f"When x is a cs.Dataset, its batches carry the targets and sample weights, "
                f"so `{name}` must not be passed beside it; put it in the dataset's elements. "
                f"Received: {name} of type {type(value).__name__}"
            )
    known = dataset.cardinality() >= 0
    batches = (_SizedBatches if known else _Batches)(dataset, class_weight)
    return TorchDataLoaderAdapter(DataLoader(batches, batch_size=None))
