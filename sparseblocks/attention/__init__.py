"""Block-sparse attention: ``attention(q, k, v, layout, causal=, scale=)`` and its gradient
``attention_grad`` over a `BlockLayout`
of the (query block, key block) grid (its builders: `BlockLayout.causal`, `strided`, `fixed`,
`global_window`, `documents`). Files: ``fused.py`` (flash-style on the tensor cores: fp16 and
bf16), ``simple.py`` (the three-kernel version, OpenAI's: scores, softmax, weighted sum, for every
dtype), ``config.py`` (`AttentionConfig`), ``api.py``; the NumPy twin is
`sparseblocks.reference.attention`."""

from .api import DTYPES, attention, attention_grad
from .config import DEFAULT, AttentionConfig

__all__ = ["attention", "attention_grad", "DTYPES", "AttentionConfig", "DEFAULT"]
