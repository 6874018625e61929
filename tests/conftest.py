"""Suite-wide fixtures: fake CUDA devices (``tests/fakegpu``) for the tests that ask.

``fake_gpus`` gives a test two fake GPUs (``@pytest.mark.fake_gpus(n)`` for another count)
and fails it at teardown if the stream checker recorded a hazard. ``fake_gpu_placement``
runs a test twice on two fake GPUs, the parameters on the CPU and on ``cuda:0``.

With ``CENTRALSTORE_FAKE_GPUS=N`` in the environment, the tests marked ``cuda``
(tests/test_cuda.py) run on N fake GPUs: ``torch.cuda`` reports them while test modules are
imported (so that their ``skipif`` marks see them), and each such test runs inside
``fakegpu.devices(N)``, checked at teardown as ``fake_gpus`` is. Other tests pay nothing.

Every test ends with ``torch.compile``'s caches emptied (``_dynamo_forgets``). What the
imports and the collection made is frozen out of the garbage collector's reach
(``pytest_collection_finish``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Generator, Iterator

import fakegpu
import pytest
import torch
from paths import FakePlacement

FAKE_GPUS_ENV = "CENTRALSTORE_FAKE_GPUS"


def _env_count() -> int:
    value = os.environ.get(FAKE_GPUS_ENV, "").strip()
    return int(value) if value else 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fake_gpus(count=2): the number of fake CUDA devices the fake_gpus fixture gives",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every full collection (a test's own, a fake GPU's check, Python's automatic ones)
    walks only what the tests made: torch's, transformers' and the test modules' objects,
    which live to the end anyway, are frozen once collected. Unfrozen, each walked about
    380,000 objects, 0.2 s."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, object, object]:
    count = _env_count()
    if count and isinstance(collector, pytest.Module):
        with fakegpu.visible(count):
            return (yield)
    return (yield)


def _checked(count: int) -> Iterator[fakegpu.FakeGPUs]:
    try:
        with fakegpu.checked(count) as gpus:
            yield gpus
    except fakegpu.HazardError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture
def fake_gpus(request: pytest.FixtureRequest) -> Iterator[fakegpu.FakeGPUs]:
    """Fake CUDA devices for this test (two, or ``@pytest.mark.fake_gpus(n)``); the test
    fails at teardown if a stream hazard was recorded and not taken (``take_hazards``)."""
    marker = request.node.get_closest_marker("fake_gpus")
    count = 2
    if marker is not None:
        count = int(marker.args[0] if marker.args else marker.kwargs.get("count", 2))
    yield from _checked(count)


REAL_GPUS_ENV = "CENTRALSTORE_REAL_GPUS"  # set by benchmarks/gpu_check.py on a GPU machine


@pytest.fixture(params=["cpu", "cuda:0"], ids=["params-on-cpu", "params-on-cuda0"])
def fake_gpu_placement(request: pytest.FixtureRequest) -> Iterator[FakePlacement]:
    """Two fake GPUs as replicas, the parameters on the CPU, then on ``cuda:0``:
    ``cs.CentralStorageStrategy(list(p.compute_devices), parameter_device=p.parameter_device)``.
    With ``CENTRALSTORE_REAL_GPUS=1`` on a machine with GPUs, the real ones instead (``gpus``
    None): ``cuda:0`` and ``cuda:1``, or with one GPU ``cuda:0`` and the logical ``cpu:1``."""
    if os.environ.get(REAL_GPUS_ENV):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("CENTRALSTORE_REAL_GPUS is set but no CUDA GPU is visible")
        second = "cuda:1" if torch.cuda.device_count() > 1 else "cpu:1"
        # the tests compare with the CPU's float32, which cuDNN's default TF32 convolutions
        # round to 10 bits (errors of 1e-2 in batch norm's statistics after three steps)
        tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
        try:
            yield FakePlacement(None, ("cuda:0", second), request.param)
        finally:
            torch.backends.cudnn.allow_tf32 = tf32
        return
    for gpus in _checked(2):
        yield FakePlacement(gpus, ("cuda:0", "cuda:1"), request.param)


@pytest.fixture(autouse=True)
def _fake_gpus_for_cuda_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    count = _env_count()
    if not count or request.node.get_closest_marker("cuda") is None:
        yield
        return
    for _ in _checked(count):
        yield


@pytest.fixture(autouse=True)
def _dynamo_forgets() -> Iterator[None]:
    """What a test compiled does not reach the tests after it in the same process: dynamo
    counts recompilations per code object (``nn.Sequential.forward`` is one for every
    test), and past its limit runs the code eagerly, which ``fullgraph=True`` refuses with
    "found no compiled frames". (It did for a guide's compiled step after the trainers'
    compile tests.) Resetting caches that hold nothing takes about 30 us."""
    yield
    torch._dynamo.reset()
