"""The one place the harness knows centralstore: fake tensors as central variables.

While a strategy's replicas run, centralstore gives each central variable a class of its
own (``CentralParameter`` or ``CentralTensor``, ``variables/views.py``) whose
``__torch_function__`` swaps it for the running replica's view, and it refuses tensor
subclasses it has no such class for. A variable on a fake GPU is a ``FakeCudaTensor``, so
while the fake GPUs are active this registers ``FakeCentral``: a ``FakeCudaTensor`` with the
views' ``__torch_function__``; and it counts ``FakeCudaTensor`` as a plain tensor and as a
parameter where a variable's class chooses the path (``EXACT_CLASSES``: variables shared
without views, writes combined in passes, buffers copied as bytes), so that the fake GPUs
take the paths a real one takes. Nothing else of centralstore is touched; if its views
module is renamed this is the function to re-point.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._tensor import FakeCudaTensor


def install(patches: Any) -> None:
    """Register ``FakeCudaTensor`` with centralstore's central classes (if importable)."""
    try:
        views = importlib.import_module("centralstore.variables.views")
    except ImportError:
        return
    central = getattr(views, "_CENTRAL_CLASS", None)
    plain = getattr(views, "_PLAIN_CLASS", None)
    if central is None or plain is None:
        return
    resolve = views.CentralTensor.__dict__["__torch_function__"]
    fake_central = type("FakeCentral", (FakeCudaTensor,), {
        "__torch_function__": resolve,
        "__doc__": "A central variable on a fake GPU while replica code runs.",
    })
    patches.setitem(central, FakeCudaTensor, fake_central)
    patches.setitem(plain, fake_central, FakeCudaTensor)
    exact = getattr(views, "EXACT_CLASSES", None)
    if exact is not None:  # fake tensors share parameters and buffers as real ones do
        for kind, classes in list(exact.items()):
            patches.setitem(exact, kind, classes | {FakeCudaTensor})
