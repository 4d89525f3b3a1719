"""OpenAI's ``SparseProj``: a one-to-one map between a few projected features and as many of the
hidden ones, with gather, scatter, scatter_add and scatter_mul and their gradients (no atomics:
the map is one to one). Files: ``kernels.py``, ``api.py``; the NumPy twin is
`sparseblocks.reference.proj`."""

from .api import DTYPES, SparseProj

__all__ = ["SparseProj", "DTYPES"]
