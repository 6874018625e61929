"""``RNGState``: the global random generators, as an object a ``Checkpoint`` can track."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any, final

import numpy as np
import torch


@final
class RNGState:
    """The global random generators: torch's CPU generator, every initialized CUDA device's,
    numpy's global ``RandomState`` and Python's ``random``.

    Track one in a ``cs.Checkpoint`` so that dropout, random augmentation and anything else
    drawing from them resume exactly where the interrupted run was. A ``Checkpoint`` restores
    it after every other object, so that reading an input pipeline again on restore (which
    may draw random numbers) does not disturb it. In a job of several workers each worker's
    generators are saved and restored (see ``Checkpoint``).

    >>> import torch
    >>> state = RNGState()
    >>> saved = state.state_dict()
    >>> first = torch.rand(2)
    >>> state.load_state_dict(saved)
    >>> torch.equal(torch.rand(2), first)
    True
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states, as tensors and numbers."""
        kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        version, words, gauss_next = random.getstate()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if cuda else [],
            "numpy": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
            "python": {
                "version": int(version),
                "words": torch.tensor(words, dtype=torch.int64),
                "gauss_next": gauss_next,
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Set the generators to the states ``state_dict()`` returned."""
        missing = [k for k in ("torch", "cuda", "numpy", "python") if k not in state_dict]
        if missing:
            raise ValueError(
                f"RNGState.load_state_dict() needs the keys torch, cuda, numpy and python; "
                f"{missing} are missing. Pass what RNGState.state_dict() returned. "
                f"Received: keys={sorted(state_dict)}"
            )
        torch.set_rng_state(state_dict["torch"])
        devices = list(state_dict["cuda"])
        if devices:
            if torch.cuda.is_available() and torch.cuda.device_count() == len(devices):
                torch.cuda.set_rng_state_all(devices)
            else:
                warnings.warn(
                    f"The checkpoint holds the random states of {len(devices)} CUDA device(s), "
                    f"and this process sees {torch.cuda.device_count()}: CUDA generators are "
                    "left as they are, so GPU random numbers will differ from the saved run.",
                    UserWarning,
                    stacklevel=2,
                )
        numpy = state_dict["numpy"]
        np.random.set_state(
            (
                numpy["kind"],
                numpy["keys"].numpy().astype(np.uint32),
                numpy["position"],
                numpy["has_gauss"],
                numpy["cached_gaussian"],
            )
        )
        python = state_dict["python"]
        words = tuple(int(w) for w in python["words"].tolist())
        random.setstate((python["version"], words, python["gauss_next"]))
