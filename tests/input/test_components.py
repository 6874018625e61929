"""How Python values become dataset components, and from_generator's signature check."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from centralstore.input.components import conform, to_components, to_numpy
from centralstore.input.spec import TensorSpec
from centralstore.input.strings import Strings

Point = collections.namedtuple("Point", ["x", "y"])


def test_structures_nest_and_leaves_become_tensors_or_strings() -> None:
    array = np.arange(3)
    value = to_components(Point([1, 2], {"a": array, "s": "t", "l": ["u", "v"]}), "f")
    assert type(value) is Point
    assert value.x.tolist() == [1, 2]
    assert value.y["a"].data_ptr() == array.ctypes.data  # shared, not copied
    assert value.y["s"] == "t"
    assert type(value.y["l"]) is Strings
    assert to_components(np.array(["a", "b"]), "f") == ["a", "b"]
    assert to_components(2.5, "f").dtype == torch.float32


def test_unsupported_components_raise_naming_the_call() -> None:
    with pytest.raises(TypeError, match=r"^Dataset\.reduce: dataset components.*NoneType"):
        to_components(None, "Dataset.reduce")
    with pytest.raises(ValueError, match=r"must be rectangular.*Received: \[\[1\], \[1, 2\]\]"):
        to_components([[1], [1, 2]], "f")


def test_conform_converts_to_the_signature() -> None:
    signature = {"n": TensorSpec((), torch.float16), "s": TensorSpec((None,), str)}
    value = conform({"n": 1, "s": ["a", "b"]}, signature, "f")
    assert value["n"].dtype == torch.float16
    assert type(value["s"]) is Strings


def test_conform_of_a_string_where_a_number_is_expected_raises() -> None:
    with pytest.raises(ValueError, match=r"output_signature entry .*it is str"):
        conform("a", TensorSpec((), torch.int64), "f")


def test_to_numpy() -> None:
    assert isinstance(to_numpy(torch.zeros(2)), np.ndarray)
    assert to_numpy(torch.tensor(2)).shape == ()
    assert to_numpy(Strings(["a"])) == ["a"]
