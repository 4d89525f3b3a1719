"""Element-wise ops (OpenAI blocksparse's ``ewops``), each a line of `ops.py` in one kernel template
(`kernels.py`), beside its NumPy twin (`sparseblocks.reference.ew`).

* unary: `negative`, `reciprocal`, `square`, `sqrt`, `exp`, `log`, `sigmoid`, `tanh`, `relu`,
  `elu(x, alpha)`; `unary(op, x)` and its gradient `unary_grad(op, dy, x, y)`;
* binary, with NumPy's broadcasting over up to 4 dimensions: `add`, `subtract`, `multiply`,
  `divide`, `maximum`, `minimum`; `binary(op, a, b)` and `binary_grad(op, dy, a, b)`;
* `add_n(xs)`: up to 8 arrays summed in one pass (OpenAI's ``add_n8``);
* `cwise_linear(x, a, b)`: ``a·x + b`` per channel of (N, C, ...), and `cwise_linear_grad`;
* `fused_lstm_gates(c, *gates)` and its gradient;
* `split4` and `concat4` along the last axis;
* `dropout(x, keep_prob, seed, offset)` on Philox bits (nothing stored for the backward,
  `dropout_grad`), optionally with its mask packed as bits (``packed``, or a given ``mask``).

Sums and math run in fp32 (fp64 for fp64) and each result is rounded once to the inputs' dtype
(fp16, bf16, fp32 or fp64).
"""

from .api import (
    DTYPES,
    add,
    add_n,
    binary,
    binary_grad,
    concat4,
    cwise_linear,
    cwise_linear_grad,
    divide,
    dropout,
    dropout_grad,
    elu,
    exp,
    fused_lstm_gates,
    fused_lstm_gates_grad,
    log,
    maximum,
    minimum,
    multiply,
    negative,
    reciprocal,
    relu,
    sigmoid,
    split4,
    sqrt,
    square,
    subtract,
    tanh,
    unary,
    unary_grad,
)
from .config import DEFAULT, EwConfig
from .ops import BINARY, UNARY

__all__ = ["unary", "unary_grad", "binary", "binary_grad", "add_n", "cwise_linear", "cwise_linear_grad",
           "fused_lstm_gates", "fused_lstm_gates_grad", "split4", "concat4", "dropout", "dropout_grad", "EwConfig", "DEFAULT", "DTYPES",
           "UNARY", "BINARY", *UNARY, *BINARY]
