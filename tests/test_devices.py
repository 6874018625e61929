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


# -- order, and no duplicates (3.1.3) --------------------------------------------------------------


def test_order_is_kept() -> None:
    strategy = cs.CentralStorageStrategy(["CPU:1", "CPU:0"])
    assert strategy.compute_devices == ("cpu:1", "cpu:0")
    assert strategy.extended.worker_devices == ("cpu:1", "cpu:0")
    devices = strategy.run(lambda: cs.get_replica_context().device)  # type: ignore[union-attr]
    assert devices.values == (torch.device("cpu", 1), torch.device("cpu", 0))


@pytest.mark.parametrize(
    ("devices", "name", "where"),
    [
        (["cpu:0", "cpu:0"], "cpu:0", "('cpu:0' at position 0 and 'cpu:0' at position 1)"),
        (["cpu", "cpu:0"], "cpu:0", "('cpu' at position 0 and 'cpu:0' at position 1)"),
        (["cpu:0", "/cpu:0", torch.device("cpu")], "cpu:0", "'/cpu:0' at position 1"),
        (["CPU:2", "cpu:1", "/device:CPU:2"], "cpu:2", "'/device:CPU:2' at position 2"),
    ],
)
def test_a_device_named_twice_raises(devices: list[object], name: str, where: str) -> None:
    match = f"compute_devices names the device '{name}' twice"
    with pytest.raises(ValueError, match=match) as info:
        cs.CentralStorageStrategy(devices)  # type: ignore[arg-type]
    message = str(info.value)
    assert where in message
    assert "'cpu:0', 'cpu:1', ..." in message  # the fix: logical CPU devices
    assert message.endswith(f"Received: compute_devices={devices!r}")


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
