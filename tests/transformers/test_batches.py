"""A Trainer batch cut into the replicas' slices, and each slice's share of the loss
(``centralstore.transformers._batches``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

from centralstore.transformers._batches import Shares, split


def test_one_replica_takes_the_batch_as_it_is_and_weighs_one() -> None:
    batch = {"input_ids": torch.zeros(5, 8), "labels": torch.ones(5, 8)}
    counted: list[object] = []
    slices = split(batch, 1)
    assert slices[0] is batch
    shares = Shares.plan(slices, torch.tensor(40), counted.append)
    assert shares == Shares([5], [1.0]) and counted == []  # nothing to count: it weighs 1


def test_two_replicas_weigh_their_share_of_the_items() -> None:
    labels = torch.tensor([[1, 1], [1, -100], [-100, -100], [1, 1]])
    slices = split({"labels": labels}, 2)
    shares = Shares.plan(slices, torch.tensor(5), lambda s: (s["labels"] != -100).sum())
    assert shares == Shares([2, 2], [0.6, 0.4])


def test_a_batch_without_examples_is_refused_on_one_replica_too() -> None:
    with pytest.raises(ValueError, match="batch dimension"):
        split({"flag": True}, 1)
