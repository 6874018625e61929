"""Device names (docs/design.md 3.1): spellings, defaults, order, and errors TensorFlow omits."""

from __future__ import annotations

import pytest
import torch

import centralstore as cs
from centralstore import _devices

GPUS = torch.cuda.device_count()
VISIBLE = str(_devices.visible_devices())  # ['cpu:0'] on a machine without GPUs
no_gpu = pytest.mark.skipif(GPUS > 0, reason="TensorFlow's defaults differ with GPUs")


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("CPU:0", "cpu:0"),
        ("cpu:0", "cpu:0"),
        ("CPU:3", "cpu:3"),
        ("/cpu:0", "cpu:0"),
        ("/CPU:2", "cpu:2"),
        ("/device:CPU:0", "cpu:0"),
        ("/device:cpu:1", "cpu:1"),
        ("/job:localhost/replica:0/task:0/device:CPU:1", "cpu:1"),
        ("/job:worker/task:3/device:CPU:0", "cpu:0"),
        ("/job:localhost/replica:0/task:0/cpu:2", "cpu:2"),
        ("cpu", "cpu:0"),
        ("CPU", "cpu:0"),
        (" cpu:1 ", "cpu:1"),
        (torch.device("cpu"), "cpu:0"),
        (torch.device("cpu", 2), "cpu:2"),
        (torch.device("cpu:1"), "cpu:1"),
    ],
)
def test_every_spelling_has_one_canonical_name(spelling: object, name: str) -> None:
    assert _devices.canonical(spelling) == name  # type: ignore[arg-type]
    strategy = cs.OneDeviceStrategy(spelling)  # type: ignore[arg-type]
    assert strategy.compute_devices == (name,)
    assert strategy.parameter_device == name


@pytest.mark.parametrize(
    "spelling",
    [f"GPU:{GPUS}", f"gpu:{GPUS + 1}", f"/device:GPU:{GPUS}",
     f"/job:localhost/replica:0/task:0/device:GPU:{GPUS}", f"cuda:{GPUS}",
     torch.device("cuda", GPUS)]
    + (["GPU", "cuda", "gpu:0"] if GPUS == 0 else []),
)
def test_a_missing_gpu_raises_naming_the_value_and_the_visible_devices(spelling: object) -> None:
    with pytest.raises(ValueError, match="GPU") as info:
        cs.CentralStorageStrategy([spelling])  # type: ignore[list-item]
    message = str(info.value)
    assert repr(spelling) in message
    assert f"visible devices: {VISIBLE}" in message


@pytest.mark.parametrize("spelling", ["tpu:0", "CPU:-1", "CPU:x", "device:CPU:0", "", "cpu:0:1"])
def test_an_unparseable_name_raises_naming_the_value_and_the_visible_devices(
    spelling: str,
) -> None:
    with pytest.raises(ValueError, match="Cannot parse the device name") as info:
        cs.CentralStorageStrategy(["cpu:0", spelling])
    assert repr(spelling) in str(info.value)
    assert VISIBLE in str(info.value)


def test_an_unsupported_torch_device_type_raises() -> None:
    with pytest.raises(ValueError, match="Unsupported device type 'meta'") as info:
        cs.OneDeviceStrategy(torch.device("meta"))
    assert VISIBLE in str(info.value)


def test_a_device_of_another_type_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"string or a torch\.device") as info:
        cs.CentralStorageStrategy([0, 1])  # type: ignore[list-item]
    assert "device=0" in str(info.value)
    assert VISIBLE in str(info.value)


def test_an_unavailable_mps_device_raises() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("mps is available here")
    with pytest.raises(ValueError, match="'mps' is not available") as info:
        cs.OneDeviceStrategy("mps")
    assert VISIBLE in str(info.value)


# -- defaults (3.1.2) --------------------------------------------------------------------------


@no_gpu
def test_default_compute_devices_are_the_cpu_without_gpus() -> None:
    strategy = cs.CentralStorageStrategy()
    assert strategy.compute_devices == ("cpu:0",)
    assert strategy.parameter_device == "cpu:0"
    assert strategy.num_replicas_in_sync == 1


def test_the_parameter_device_defaults_to_the_cpu_with_several_compute_devices() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:1", "cpu:2"])
    assert strategy.parameter_device == "cpu:0"
    assert strategy.extended.parameter_devices == ("cpu:0",)


def test_the_parameter_device_defaults_to_the_only_compute_device() -> None:
    assert cs.CentralStorageStrategy(["cpu:1"]).parameter_device == "cpu:1"


def test_an_explicit_parameter_device_is_canonicalised() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="/device:CPU:1")
    assert strategy.parameter_device == "cpu:1"
    assert strategy.extended.parameter_devices == ("cpu:1",)


def test_a_missing_parameter_device_raises() -> None:
    with pytest.raises(ValueError, match=f"'GPU:{GPUS}'"):
        cs.CentralStorageStrategy(["cpu:0"], parameter_device=f"GPU:{GPUS}")


# -- order, and duplicates (3.1.3) ----------------------------------------------------------------


def test_order_is_kept() -> None:
    strategy = cs.CentralStorageStrategy(["CPU:1", "CPU:0"])
    assert strategy.compute_devices == ("cpu:1", "cpu:0")
    assert strategy.extended.worker_devices == ("cpu:1", "cpu:0")
    devices = strategy.run(lambda: cs.get_replica_context().device)  # type: ignore[union-attr]
    assert devices.values == (torch.device("cpu", 1), torch.device("cpu", 0))


@pytest.mark.parametrize(
    ("devices", "names"),
    [
        (["/cpu:0", "/cpu:0"], ("cpu:0", "cpu:0")),  # TensorFlow 2.21: 2 replicas on CPU:0
        (["cpu:0", "cpu:0"], ("cpu:0", "cpu:0")),
        (["cpu", "cpu:0"], ("cpu:0", "cpu:0")),
        (["cpu:0", "/cpu:0", torch.device("cpu")], ("cpu:0", "cpu:0", "cpu:0")),
        (["cpu:0", "cpu:0", "cpu:1"], ("cpu:0", "cpu:0", "cpu:1")),
        (["CPU:2", "cpu:1", "/device:CPU:2"], ("cpu:2", "cpu:1", "cpu:2")),
    ],
)
def test_a_device_named_twice_runs_a_replica_for_each_entry(
    devices: list[object], names: tuple[str, ...]
) -> None:
    """As TensorFlow measured: ``CentralStorageStrategy(["/cpu:0", "/cpu:0"])`` has 2
    replicas, both on CPU:0. Every entry is a replica, in order, duplicates kept."""
    strategy = cs.CentralStorageStrategy(devices)  # type: ignore[arg-type]
    assert strategy.compute_devices == names
    assert strategy.num_replicas_in_sync == len(devices)
    assert strategy.extended.worker_devices == names
    assert strategy.parameter_device == "cpu:0"  # several compute devices: the CPU
    assert strategy.extended.parameter_devices == ("cpu:0",)
    assert repr(strategy) == (
        f"CentralStorageStrategy(compute_devices={list(names)}, parameter_device='cpu:0')"
    )

    def where() -> tuple[int, torch.device]:
        rc = cs.get_replica_context()
        assert rc is not None
        return rc.replica_id_in_sync_group, rc.device

    ids, places = strategy.run(where)
    assert strategy.experimental_local_results(ids) == tuple(range(len(devices)))
    assert strategy.experimental_local_results(places) == tuple(
        _devices.torch_device(name) for name in names
    )


def test_two_replicas_on_one_device_keep_their_own_values() -> None:
    """Nothing is keyed by device: run, local results, reduce, gather, all_reduce,
    all_gather and merge_call see one component per replica, on ``["cpu:0", "cpu:0",
    "cpu:1"]`` as on three devices."""
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:0", "cpu:1"])
    inputs = cs.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([])])

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rc = cs.get_replica_context()
        assert rc is not None
        total = rc.all_reduce("SUM", x.sum())
        gathered = rc.all_gather(x, axis=0)
        merged = rc.merge_call(
            lambda s, v: tuple(t.tolist() for t in s.experimental_local_results(v)), args=(x,)
        )
        assert merged == ([1.0, 2.0], [3.0], [])
        return x * 10, total, gathered, torch.tensor(float(rc.replica_id_in_sync_group))

    scaled, total, gathered, ids = strategy.run(step, args=(inputs,))
    assert [t.tolist() for t in strategy.experimental_local_results(scaled)] == [
        [10.0, 20.0], [30.0], []
    ]
    assert [t.item() for t in strategy.experimental_local_results(total)] == [6.0] * 3
    assert [t.tolist() for t in strategy.experimental_local_results(gathered)] == [
        [1.0, 2.0, 3.0]
    ] * 3
    assert strategy.reduce("SUM", ids, axis=None).item() == 3.0
    assert strategy.reduce("MEAN", ids, axis=None).item() == 1.0
    assert strategy.reduce("SUM", scaled, axis=0).item() == 60.0
    assert strategy.reduce("MEAN", scaled, axis=0).item() == 20.0
    assert strategy.gather(scaled, axis=0).tolist() == [10.0, 20.0, 30.0]


@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")
def test_a_gpu_named_twice_runs_two_replicas_on_it() -> None:
    """The same rule on a GPU: ``["cuda:0", "cuda:0"]`` is two replicas on cuda:0, and with
    several compute devices the variables default to the CPU, as in TensorFlow."""
    strategy = cs.CentralStorageStrategy(["cuda:0", "GPU:0"])
    assert strategy.compute_devices == ("cuda:0", "cuda:0")
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended.worker_devices == ("cuda:0", "cuda:0")
    assert strategy.parameter_device == "cpu:0"
    places = strategy.run(lambda: cs.get_replica_context().device)  # type: ignore[union-attr]
    assert strategy.experimental_local_results(places) == (torch.device("cuda", 0),) * 2
    x = strategy.run(
        lambda: torch.full((2,), float(cs.get_replica_context().replica_id_in_sync_group))  # type: ignore[union-attr]
    )
    assert [t.device.type for t in strategy.experimental_local_results(x)] == ["cuda", "cuda"]
    assert strategy.reduce("SUM", x, axis=0).item() == 2.0


def test_canonical_names_appear_in_repr() -> None:
    strategy = cs.CentralStorageStrategy(["/device:CPU:0", "CPU:1"])
    assert repr(strategy) == (
        "CentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1'], parameter_device='cpu:0')"
    )


# -- the errors of 3.1.4 -----------------------------------------------------------------------


def test_an_empty_list_raises() -> None:
    with pytest.raises(ValueError, match="compute_devices is empty") as info:
        cs.CentralStorageStrategy([])
    assert "compute_devices=[]" in str(info.value)
    assert VISIBLE in str(info.value)


@pytest.mark.parametrize("device", ["cpu:0", "CPU:0,CPU:1", torch.device("cpu")])
def test_a_bare_device_instead_of_a_list_raises(device: object) -> None:
    with pytest.raises(TypeError, match="not a single device") as info:
        cs.CentralStorageStrategy(device)  # type: ignore[arg-type]
    assert repr(device) in str(info.value)
    assert VISIBLE in str(info.value)


@pytest.mark.parametrize("devices", [{"cpu:0"}, iter(["cpu:0"]), b"cpu:0"])
def test_a_non_sequence_raises(devices: object) -> None:
    with pytest.raises(TypeError, match="list or tuple of devices") as info:
        cs.CentralStorageStrategy(devices)  # type: ignore[arg-type]
    assert VISIBLE in str(info.value)


# -- canonical names work in torch calls -------------------------------------------------------


def test_canonical_names_work_in_torch_calls() -> None:
    strategy = cs.CentralStorageStrategy(["cpu:0", "cpu:1"])
    for name in strategy.compute_devices:
        tensor = torch.zeros(2, device=name)
        assert tensor.device == torch.device("cpu")
    assert torch.zeros(2, device="cpu:1").device.type == "cpu"


def test_torch_and_storage_devices() -> None:
    assert _devices.torch_device("cpu:1") == torch.device("cpu", 1)
    assert _devices.storage_device("cpu:1") == torch.device("cpu")
    assert _devices.storage_device("cpu:3") == _devices.storage_device("cpu:0")
    assert _devices.visible_devices()[0] == "cpu:0"


@no_gpu
def test_the_visible_devices_without_gpus() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("mps is visible here")
    assert _devices.visible_devices() == ["cpu:0"]
    assert _devices.default_compute_devices() == ("cpu:0",)
