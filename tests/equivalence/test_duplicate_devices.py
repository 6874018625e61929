"""Replicas on a device named twice train like one device (docs/design.md 3.1.3).

TensorFlow 2.21 accepts a device named twice: ``CentralStorageStrategy(["/cpu:0", "/cpu:0"])``
has 2 replicas, both on CPU:0 (measured). Here ``["cpu:0", "cpu:0"]`` and ``["cpu:0", "cpu:0",
"cpu:1"]`` train a Linear + BatchNorm1d model with SGD on global batches read through
``experimental_distribute_dataset``, the loss scaled by the global batch, and reach the
weights of one device on the same global batches. BatchNorm in training mode normalizes each
replica's slice on its own and averages the replicas' running statistics (3.6.4, 3.6.5), so
the one-device oracle of that model runs the replicas' slices one after the other from the
same statistics; the model without BatchNorm is compared with one device on the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from replicas import see_views
from torch import nn

import centralstore as cs
from centralstore.input.split import split_sizes

FEATURES = 5
EXAMPLES = 30
GLOBAL_BATCH = 8  # batches of 8, 8, 8 and 6: slices 4/4 and 3/3, or 3/3/2 and 2/2/2
EPOCHS = 2
LR = 0.1
ATOL = 1e-6

DUPLICATES = [
    pytest.param(("cpu:0", "cpu:0"), id="cpu:0+cpu:0"),
    pytest.param(("cpu:0", "cpu:0", "cpu:1"), id="cpu:0+cpu:0+cpu:1"),
]


def batchnorm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))


def linear_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 6), nn.ReLU(), nn.Linear(6, 1))


MODELS: dict[str, Callable[[], nn.Module]] = {"batchnorm": batchnorm_model, "linear": linear_model}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(EXAMPLES, FEATURES, generator=generator)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(EXAMPLES, 1, generator=generator)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data()
    return [
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, EXAMPLES, GLOBAL_BATCH)
    ]


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(1)


def one_device(model: nn.Module, replicas: int, per_slice: bool) -> list[float]:
    """Plain PyTorch on one device, the same global batches and scaled losses; the losses.

    ``per_slice``: the replicas' slices of each batch one after the other, each normalized by
    BatchNorm from the same buffers, which then aggregate as central variables do (3.6.5):
    floating ones (the running statistics) to the mean of the slices', integer ones (the
    step counter) to the first slice's; else each batch whole."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    stats = list(model.buffers())
    losses = []
    for _ in range(EPOCHS):
        for x, y in global_batches():
            g = len(x)
            optimizer.zero_grad()
            before = [b.clone() for b in stats]
            after, total, start = [], 0.0, 0
            for count in split_sizes(g, replicas) if per_slice else [g]:
                with torch.no_grad():
                    for b, value in zip(stats, before, strict=True):
                        b.copy_(value)
                xs, ys = x[start : start + count], y[start : start + count]
                loss = cs.compute_average_loss(per_example_loss(model, xs, ys), global_batch_size=g)
                loss.backward()
                total += loss.item()
                after.append([b.clone() for b in stats])
                start += count
            with torch.no_grad():
                for i, b in enumerate(stats):
                    values = [slices[i] for slices in after]
                    b.copy_(torch.stack(values).mean(0) if b.is_floating_point() else values[0])
            losses.append(total)
            optimizer.step()
    return losses


def replicated(
    devices: tuple[str, ...], make_model: Callable[[], nn.Module], state: dict, direct: bool
) -> tuple[nn.Module, list[float]]:
    """``make_model`` trained by a strategy on ``devices``; its model and summed losses."""
    strategy = cs.CentralStorageStrategy(list(devices))
    assert strategy.compute_devices == devices
    assert strategy.num_replicas_in_sync == len(devices)
    if not direct:  # every replica on views of the variables, as replicas on GPUs are
        see_views(strategy)
    with strategy.scope():
        model = make_model()
        model.load_state_dict(state)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data()
    dataset = cs.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist = strategy.experimental_distribute_dataset(dataset)

    def step(xs: torch.Tensor, ys: torch.Tensor, global_batch: int) -> torch.Tensor:
        rc = cs.get_replica_context()
        assert rc is not None
        assert rc.device == torch.device(devices[rc.replica_id_in_sync_group])
        loss = cs.compute_average_loss(
            per_example_loss(model, xs, ys), global_batch_size=global_batch
        )
        loss.backward()
        return loss.detach()

    losses = []
    for _ in range(EPOCHS):
        for xs, ys in dist:
            global_batch = sum(len(s) for s in strategy.experimental_local_results(xs))
            optimizer.zero_grad()
            out = strategy.run(step, args=(xs, ys, global_batch))
            losses.append(strategy.reduce("SUM", out, axis=None).item())
            optimizer.step()
    return model, losses


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "views"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("devices", DUPLICATES)
def test_a_device_named_twice_trains_like_one_device(
    devices: tuple[str, ...], model_name: str, direct: bool
) -> None:
    torch.manual_seed(0)
    oracle = MODELS[model_name]()
    state = copy.deepcopy(oracle.state_dict())
    expected_losses = one_device(oracle, len(devices), per_slice=model_name == "batchnorm")
    model, losses = replicated(devices, MODELS[model_name], state, direct)
    assert losses == pytest.approx(expected_losses, abs=ATOL)
    want = oracle.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, want[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("devices", DUPLICATES)
def test_a_device_named_twice_trains_as_distinct_devices_do(devices: tuple[str, ...]) -> None:
    """The same replicas on distinct logical CPU devices compute bit for bit the same."""
    torch.manual_seed(0)
    state = copy.deepcopy(batchnorm_model().state_dict())
    distinct = tuple(f"cpu:{i}" for i in range(len(devices)))
    model, losses = replicated(devices, batchnorm_model, state, direct=True)
    reference, reference_losses = replicated(distinct, batchnorm_model, state, direct=True)
    assert losses == reference_losses
    want = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name
