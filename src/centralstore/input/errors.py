"""The exceptions of TensorFlow's ``tf.errors`` that centralstore raises: ``OutOfRangeError``
and ``DataLossError``."""

from __future__ import annotations


class OutOfRangeError(Exception):
    """``get_next()`` on an exhausted iterator: the data has run out.

    ``next()`` raises ``StopIteration`` instead, as Python's protocol asks, so ``for`` loops
    end normally; ``get_next`` keeps TensorFlow's error so that ported ``try``/``except``
    code still works. It is not a ``StopIteration``, which a generator would swallow.

    >>> raise OutOfRangeError("End of sequence")
    Traceback (most recent call last):
    ...
    centralstore.input.errors.OutOfRangeError: End of sequence
    """


class DataLossError(Exception):
    """A checkpoint file that cannot be read back: truncated, corrupt, or not a checkpoint.

    TensorFlow's ``tf.errors.DataLossError``. The message names the file; a checkpoint
    manager's earlier checkpoints are untouched, so deleting the damaged file makes the
    previous one the latest.

    >>> raise DataLossError("ckpt-3 is truncated")
    Traceback (most recent call last):
    ...
    centralstore.input.errors.DataLossError: ckpt-3 is truncated
    """
