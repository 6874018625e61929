"""TensorSpec: construction, compatibility, the spec of elements and shapes as arguments."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from centralstore._values import PerReplica
from centralstore.input.spec import TensorSpec, as_shape, spec_of
from centralstore.input.strings import Strings


def test_tensor_spec_is_a_frozen_value_like_tensorflows() -> None:
    spec = TensorSpec([None, 3], torch.float32, name="x")
    assert spec.shape == (None, 3)
    assert spec == TensorSpec((None, 3), torch.float32, "x")
    assert repr(spec) == "TensorSpec(shape=(None, 3), dtype=torch.float32, name='x')"
    assert repr(TensorSpec(None, str)) == "TensorSpec(shape=None, dtype=str)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.shape = (1,)  # type: ignore[misc]
    assert hash(spec) == hash(TensorSpec((None, 3), torch.float32, "x"))


def test_from_tensor_reads_tensors_numpy_and_strings() -> None:
    assert TensorSpec.from_tensor(np.zeros((2, 1), np.int8)) == TensorSpec((2, 1), torch.int8)
    assert TensorSpec.from_tensor("a") == TensorSpec((), str)
    assert TensorSpec.from_tensor(b"a") == TensorSpec((), bytes)
    nested = Strings([Strings(["a", "b"]), Strings(["c", "d"])])
    assert TensorSpec.from_tensor(nested) == TensorSpec((2, 2), str)
    assert TensorSpec.from_tensor(Strings([])) == TensorSpec((0,), str)


@pytest.mark.parametrize(
    ("spec", "value", "fits"),
    [
        (TensorSpec((None, 2)), torch.zeros(7, 2), True),
        (TensorSpec((None, 2)), torch.zeros(7, 3), False),
        (TensorSpec((None, 2)), torch.zeros(7), False),
        (TensorSpec((None, 2)), torch.zeros(7, 2, dtype=torch.int32), False),
        (TensorSpec(None), torch.zeros(1, 2, 3), True),
        (TensorSpec((None,), str), Strings(["a"]), True),
        (TensorSpec((), str), b"a", False),
        (TensorSpec((None, 2)), TensorSpec(None), True),
    ],
)
def test_is_compatible_with(spec: TensorSpec, value: object, fits: bool) -> None:
    assert spec.is_compatible_with(value) is fits


def test_spec_of_a_step_describes_one_replica_with_an_unknown_batch_dimension() -> None:
    step = (PerReplica([torch.zeros(3, 4), torch.zeros(2, 4)]), {"s": Strings(["a"])})
    assert spec_of(step, batched=True) == (
        TensorSpec((None, 4), torch.float32),
        {"s": TensorSpec((None,), str)},
    )
    assert spec_of(torch.tensor(1.0), batched=True) == TensorSpec((), torch.float32)
    assert spec_of(torch.zeros(3, 4), batched=False) == TensorSpec((3, 4), torch.float32)


def test_shapes_as_arguments() -> None:
    assert as_shape("f", "shape", torch.Size([2, 3])) == (2, 3)
    assert as_shape("f", "shape", np.int64(4)) == (4,)
    assert as_shape("f", "shape", ()) == ()


@pytest.mark.parametrize("shape", ["ab", 1.5, [2, -3], [None, "x"], True])
def test_bad_shapes_raise_naming_the_call(shape: object) -> None:
    with pytest.raises(TypeError, match=r"TensorSpec\(shape\) must be a shape"):
        TensorSpec(shape)  # type: ignore[arg-type]


def test_spec_of_something_that_is_no_tensor_raises() -> None:
    with pytest.raises(TypeError, match="Received: a object"):
        TensorSpec.from_tensor(object())


def test_bad_dtypes_raise() -> None:
    with pytest.raises(TypeError, match="Received: dtype='float32'"):
        TensorSpec((), "float32")  # type: ignore[arg-type]
