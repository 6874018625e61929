"""cs.data.Options and AutoShardPolicy: TensorFlow's spelling, merging, and the errors."""

from __future__ import annotations

import pickle

import pytest

from centralstore.input.data_options import (
    AUTOTUNE,
    AutoShardPolicy,
    DistributeOptions,
    Options,
    merged,
)


def test_tensorflow_tutorial_options_spelling() -> None:
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.DATA
    assert isinstance(options.experimental_distribute, DistributeOptions)


def test_defaults_and_tensorflow_values() -> None:
    options = Options()
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.AUTO
    assert options.deterministic is None
    assert AUTOTUNE == -1
    assert {p.name: int(p) for p in AutoShardPolicy} == {
        "OFF": -1,
        "AUTO": 0,
        "FILE": 1,
        "DATA": 2,
        "HINT": 3,
    }
    assert repr(options) == "Options()"


def test_deterministic_and_its_older_name_are_one_setting() -> None:
    options = Options()
    options.experimental_deterministic = False
    assert options.deterministic is False
    with pytest.raises(TypeError, match="Received: deterministic='yes'"):
        options.deterministic = "yes"  # type: ignore[assignment]


def test_merge_keeps_what_was_set_and_later_settings_win() -> None:
    first, second = Options(), Options()
    first.deterministic = True
    first.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    second.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    result = merged(first, None, second)
    assert result.deterministic is True
    assert result.experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
    assert result != first
    assert merged(first) == first
    assert merged(first) is not first


def test_options_pickle_and_compare() -> None:
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    assert pickle.loads(pickle.dumps(options)) == options
    assert options != "OFF"


@pytest.mark.parametrize("name", ["threading", "experimental_optimization", "autotune"])
def test_tensorflow_runtime_options_say_they_have_no_counterpart(name: str) -> None:
    with pytest.raises(AttributeError, match=f"no counterpart here.*Received: attribute='{name}'"):
        getattr(Options(), name)
    with pytest.raises(AttributeError, match="no counterpart here"):
        setattr(Options(), name, 1)


def test_unknown_options_list_the_supported_ones() -> None:
    with pytest.raises(AttributeError, match=r"not an option.*Supported: deterministic, "):
        Options().shuffle = True  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match=r"no counterpart.*Supported: auto_shard_policy"):
        Options().experimental_distribute.num_devices = 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("policy", "error"), [("DATA", TypeError), (True, TypeError), (7, ValueError)]
)
def test_auto_shard_policy_must_be_a_policy(policy: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"Received: auto_shard_policy={policy!r}"):
        Options().experimental_distribute.auto_shard_policy = policy  # type: ignore[assignment]


def test_auto_shard_policy_accepts_its_int_value() -> None:
    options = Options()
    options.experimental_distribute.auto_shard_policy = -1  # type: ignore[assignment]
    assert options.experimental_distribute.auto_shard_policy is AutoShardPolicy.OFF
