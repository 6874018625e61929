"""``OneDeviceStrategy``: every strategy call, with one replica on one device; and the
default strategy, in force outside every scope."""

from __future__ import annotations

from typing import final

from .. import _context, _devices
from .._devices import DeviceLike
from .base import Strategy


@final
class OneDeviceStrategy(Strategy):
    """One replica on ``device``, which also stores the variables. Code written for
    ``CentralStorageStrategy`` runs unchanged; ``get_strategy()`` returns one on ``cpu:0``
    outside every scope.

    >>> import centralstore as cs
    >>> cs.OneDeviceStrategy("cpu").run(lambda x: x + 1, args=(1,))
    2
    """

    def __init__(self, device: DeviceLike) -> None:
        name = _devices.canonical(device)
        super().__init__((name,), name)


def _default_entry() -> _context.Entry:
    """The bottom of every thread's context stack: a ``OneDeviceStrategy`` on ``cpu:0`` with
    its default replica context."""
    return OneDeviceStrategy("cpu:0")._default_entry()


_context.install_default(_default_entry)
