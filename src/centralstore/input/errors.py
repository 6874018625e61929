"""The input pipeline's own exception: ``OutOfRangeError`` (``tf.errors.OutOfRangeError``)."""

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
