"""cs.data and cs.data.experimental: the tf.data names, pinned."""

from __future__ import annotations

from centralstore.input import data, data_experimental
from centralstore.input.data_options import AutoShardPolicy
from centralstore.input.dataset import Dataset
from centralstore.input.spec import TensorSpec


def test_public_names_are_pinned() -> None:
    assert sorted(data.__all__) == [
        "AUTOTUNE",
        "AutoShardPolicy",
        "Dataset",
        "DistributeOptions",
        "INFINITE_CARDINALITY",
        "Options",
        "TensorSpec",
        "UNKNOWN_CARDINALITY",
        "experimental",
    ]
    assert all(hasattr(data, name) for name in data.__all__)
    assert all(hasattr(data_experimental, name) for name in data_experimental.__all__)


def test_names_are_the_objects_of_the_input_package() -> None:
    assert data.Dataset is Dataset
    assert data.TensorSpec is TensorSpec
    assert data.experimental is data_experimental
    assert data.experimental.AutoShardPolicy is data.AutoShardPolicy is AutoShardPolicy
    assert (data.AUTOTUNE, data.INFINITE_CARDINALITY, data.UNKNOWN_CARDINALITY) == (-1, -1, -2)
