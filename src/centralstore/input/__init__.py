"""The input pipeline: ``Dataset``, the split rule, input options, and distributed datasets.

The public names are re-exported from ``centralstore``; import them from there.
"""
