"""``centralstore demo``: a small CNN on scikit-learn's handwritten digits, trained with
``CentralStorageStrategy`` and once more as a plain one-device loop, then compared.

Layered so that every import points down: ``job`` (the settings, data, model and optimizer
every run shares) under ``one_device`` (the oracle) and ``report`` (what the user sees), both
under ``train`` (the distributed run and the whole job). Only public API is used
(``import centralstore as cs``), and the split rule from ``centralstore.input.split``.
"""

from .job import Settings as Settings
from .job import make_strategy as make_strategy
from .train import run as run
