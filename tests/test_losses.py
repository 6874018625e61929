"""compute_average_loss and scale_regularization_loss: the errors that catch a wrong loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import centralstore as cs
from centralstore._losses import weighted


@pytest.mark.parametrize(
    "per_example_loss", [torch.tensor(2.0), 2.0, torch.nn.MSELoss()(torch.ones(4), torch.zeros(4))]
)
@pytest.mark.parametrize("sample_weight", [None, 1.0])
def test_a_scalar_per_example_loss_raises(per_example_loss: Any, sample_weight: Any) -> None:
    with pytest.raises(ValueError, match="needs one loss per example") as info:
        cs.compute_average_loss(per_example_loss, sample_weight, global_batch_size=64)
    message = str(info.value)
    assert 'reduction="none"' in message
    assert message.endswith(f"Received: per_example_loss={per_example_loss!r}")


def test_a_scalar_per_example_loss_raises_in_a_replica_too() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="needs one loss per example"):
        strategy.run(lambda: cs.compute_average_loss(torch.tensor(2.0)))


@settings(max_examples=40, deadline=None, database=None)
@given(
    losses=st.lists(st.floats(0, 100, width=32), min_size=1, max_size=8),
    extra=st.integers(0, 8),
)
def test_rank_one_losses_are_summed_and_divided_by_the_global_batch(
    losses: list[float], extra: int
) -> None:
    global_batch = len(losses) + extra
    result = cs.compute_average_loss(torch.tensor(losses), global_batch_size=global_batch)
    torch.testing.assert_close(result, torch.tensor(losses).sum() / global_batch)


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_a_weighted_loss_adds_no_node_for_a_weight_of_one(weight: float) -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * x).sum()
    share = weighted(loss, weight)
    assert (share.grad_fn is loss.grad_fn) == (weight == 1.0)
    share.backward()
    assert x.grad is not None
    assert torch.equal(x.grad, 2 * x.detach() * weight)
