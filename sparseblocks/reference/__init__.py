"""Readable NumPy twins of the kernels; they fix the semantics the kernels must match.

Every function here runs in float64 by default (``upcast=True``) so tests can
measure a kernel's error against a result far more accurate than the kernel's.
"""
