"""``Options`` of a ``Dataset`` (``cs.data.Options``), and ``AutoShardPolicy``.

TensorFlow's ``tf.data.Options`` holds many knobs for its runtime (threading, graph
optimizations, autotuning) that a pipeline of Python generators has no counterpart for;
those raise ``AttributeError`` instead of being accepted and ignored. What remains is the
sharding policy that ``experimental_distribute_dataset`` follows across workers, and
``deterministic``, which every pipeline here already is.

Options merge as in TensorFlow: a dataset carries the options of its inputs, and what
``with_options`` sets last wins; options never set keep their defaults.
"""

from __future__ import annotations

import enum
from typing import Any, final

AUTOTUNE = -1
"""``tf.data.AUTOTUNE``: let the pipeline choose (a buffer size, a parallelism)."""


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shares a dataset among the workers of a job.

    ``AUTO`` and ``DATA``: every worker iterates the same global batches and keeps its own
    replicas' slices of each, so every example is seen by exactly one replica, as with
    TensorFlow's ``DATA``. ``OFF``: every worker splits each global batch over its own
    replicas only, so every worker sees all the data, as with TensorFlow's ``OFF``.
    ``FILE`` and ``HINT`` are not supported (no file-reading sources here): distributing a
    dataset with them raises ``ValueError``. With one worker all policies agree.

    >>> AutoShardPolicy.DATA, int(AutoShardPolicy.OFF)
    (<AutoShardPolicy.DATA: 2>, -1)
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


_NO_COUNTERPART = (
    "is a setting of TensorFlow's tf.data runtime with no counterpart here (pipelines are "
    "Python generators on the iterating thread; DataLoader workers give parallelism)"
)
_TF_ONLY = frozenset(
    {
        "autotune",
        "experimental_external_state_policy",
        "experimental_optimization",
        "experimental_slack",
        "experimental_symbolic_checkpoint",
        "experimental_threading",
        "experimental_warm_start",
        "framework_type",
        "threading",
        "num_devices",
        "dataset_sharing_options",
    }
)


class _Settable:
    """Options objects: known settings only, with an error naming the fix for the rest."""

    __slots__ = ()
    _settings: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in self._settings:
            object.__setattr__(self, name, value)
            return
        raise AttributeError(_unknown(type(self).__name__, name, self._settings))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(_unknown(type(self).__name__, name, self._settings))


@final
class DistributeOptions(_Settable):
    """``Options().experimental_distribute``: how a dataset is shared among workers.

    >>> options = Options()
    >>> options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    >>> options.experimental_distribute.auto_shard_policy
    <AutoShardPolicy.DATA: 2>
    """

    __slots__ = ("_auto_shard_policy",)
    _settings = frozenset({"auto_shard_policy"})

    def __init__(self) -> None:
        self._auto_shard_policy: AutoShardPolicy | None = None  # None: never set

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """The ``AutoShardPolicy`` (default ``AUTO``)."""
        policy = self._auto_shard_policy
        return AutoShardPolicy.AUTO if policy is None else policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, policy: AutoShardPolicy) -> None:
        if isinstance(policy, bool) or not isinstance(policy, int):
            raise TypeError(
                "Options().experimental_distribute.auto_shard_policy must be an "
                "AutoShardPolicy, e.g. cs.data.AutoShardPolicy.DATA. "
                f"Received: auto_shard_policy={policy!r}"
            )
        try:
            self._auto_shard_policy = AutoShardPolicy(policy)
        except ValueError:
            raise ValueError(
                "Options().experimental_distribute.auto_shard_policy must be one of "
                f"{[p.name for p in AutoShardPolicy]}. Received: auto_shard_policy={policy!r}"
            ) from None


@final
class Options(_Settable):
    """Options of a dataset, attached with ``Dataset.with_options`` (``tf.data.Options``).

    >>> options = Options()
    >>> options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    >>> options.deterministic = True
    >>> options
    Options(deterministic=True, experimental_distribute.auto_shard_policy=AutoShardPolicy.OFF)
    """

    __slots__ = ("_deterministic", "_distribute")
    _settings = frozenset({"deterministic", "experimental_deterministic"})

    def __init__(self) -> None:
        self._distribute = DistributeOptions()
        self._deterministic: bool | None = None

    @property
    def experimental_distribute(self) -> DistributeOptions:
        """How the dataset is shared among workers (``auto_shard_policy``)."""
        return self._distribute

    @property
    def deterministic(self) -> bool | None:
        """Whether elements come in a deterministic order; they always do here.

        Accepted for porting: ``map`` and ``interleave`` run in order on the iterating
        thread, so ``False`` changes nothing.
        """
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"Options().deterministic must be a bool or None. Received: deterministic={value!r}"
            )
        self._deterministic = value

    experimental_deterministic = deterministic  # TensorFlow's earlier name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Options):
            return NotImplemented
        return _values(self) == _values(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as TensorFlow's

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in _values(self).items())
        return f"Options({fields})"


def merged(*options: Options | None) -> Options:
    """One ``Options`` with every setting made in ``options``, later ones winning.

    >>> first, second = Options(), Options()
    >>> first.deterministic = False
    >>> second.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    >>> merged(first, second)
    Options(deterministic=False, experimental_distribute.auto_shard_policy=AutoShardPolicy.OFF)
    """
    result = Options()
    for each in options:
        if each is None:
            continue
        if each._deterministic is not None:
            result._deterministic = each._deterministic
        policy = each._distribute._auto_shard_policy
        if policy is not None:
            result._distribute._auto_shard_policy = policy
    return result


def _values(options: Options) -> dict[str, Any]:
    """The settings made, by name: what ``==`` compares and the repr shows."""
    values: dict[str, Any] = {}
    if options._deterministic is not None:
        values["deterministic"] = options._deterministic
    policy = options._distribute._auto_shard_policy
    if policy is not None:
        values["experimental_distribute.auto_shard_policy"] = f"AutoShardPolicy.{policy.name}"
    return values


def _unknown(owner: str, name: str, settings: frozenset[str]) -> str:
    known = ", ".join(sorted(settings - {"experimental_deterministic"}))
    if owner == "Options":
        known += ", experimental_distribute.auto_shard_policy"
    why = _NO_COUNTERPART if name in _TF_ONLY else "is not an option of a dataset"
    return (
        f"cs.data.{owner} has no {name!r}: it {why}. Supported: {known}. "
        "See the tf.data table in docs/data.md for the options and methods that port. "
        f"Received: attribute={name!r}"
    )
