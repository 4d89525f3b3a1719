"""The element-wise ops for torch, differentiable: `unary`, `binary` (and each op by name:
``sigmoid(x)``, ``maximum(a, b)``, ...), `add_n`, `cwise_linear` and `fused_lstm_gates`.

Each is a torch custom op (``torch.ops.sparseblocks.ew_unary``, ``ew_binary``, ``ew_lstm_gates``,
``ew_cwise_linear``, ``ew_add_n``) with a fake kernel and autograd through its gradient op, so that
`torch.compile(fullgraph=True)` takes them with no graph break. On a GPU they run the kernels
(`sparseblocks.ew`); on CPU tensors torch's operations compute the same formulas (in fp32, fp64
for fp64), unless the kernels were asked for (`torch.cpu.kernels_on_cpu`).
"""

from typing import List, Optional, Tuple

import torch

from .. import ew as kernels
from ..ew.ops import BINARY, UNARY
from . import cpu


def _acc(t):
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


_UNARY = {
    "negative": (lambda x, a: -x, lambda dy, x, y, a: -dy),
    "reciprocal": (lambda x, a: 1 / x, lambda dy, x, y, a: -dy * y * y),
    "square": (lambda x, a: x * x, lambda dy, x, y, a: 2 * x * dy),
    "sqrt": (lambda x, a: torch.sqrt(x), lambda dy, x, y, a: dy * 0.5 / y),
    "exp": (lambda x, a: torch.exp(x), lambda dy, x, y, a: dy * y),
    "log": (lambda x, a: torch.log(x), lambda dy, x, y, a: dy / x),
    "sigmoid": (lambda x, a: torch.sigmoid(x), lambda dy, x, y, a: dy * y * (1 - y)),
    "tanh": (lambda x, a: torch.tanh(x), lambda dy, x, y, a: dy * (1 - y * y)),
    "relu": (lambda x, a: torch.where(x < 0, torch.zeros_like(x), x), lambda dy, x, y, a: torch.where(x > 0, dy, 0 * dy)),
    "elu": (lambda x, a: torch.where(x > 0, x, a * torch.expm1(torch.clamp(x, max=0))),
            lambda dy, x, y, a: torch.where(x > 0, dy, dy * (y + a))),
}
_BINARY = {
    "add": (torch.add, lambda dy, a, b: (dy, dy)),
    "subtract": (torch.sub, lambda dy, a, b: (dy, -dy)),
    "multiply": (torch.mul, lambda dy, a, b: (dy * b, dy * a)),
    "divide": (torch.div, lambda dy, a, b: (dy / b, -dy * a / (b * b))),
    "maximum": (torch.maximum, lambda dy, a, b: (torch.where(a == b, dy / 2, torch.where(a > b, dy, 0 * dy)),
                                                 torch.where(a == b, dy / 2, torch.where(a > b, 0 * dy, dy)))),
    "minimum": (torch.minimum, lambda dy, a, b: (torch.where(a == b, dy / 2, torch.where(a < b, dy, 0 * dy)),
                                                 torch.where(a == b, dy / 2, torch.where(a < b, 0 * dy, dy)))),
}


def _check(op, table):
    if op not in table:
        raise ValueError(f"op: expected one of {tuple(table)}, got {op!r}")


# -- unary ----------------------------------------------------------------------------


@torch.library.custom_op("sparseblocks::ew_unary", mutates_args=())
def unary_op(x: torch.Tensor, op: str, alpha: float) -> torch.Tensor:
    _check(op, UNARY)
    if cpu.takes(x):
        kernels.api._operands([("x", x)])
        return _UNARY[op][0](_acc(x), alpha).to(x.dtype)
    return kernels.unary(op, x, alpha)


@torch.library.custom_op("sparseblocks::ew_unary_grad", mutates_args=())
def unary_grad_op(dy: torch.Tensor, x: torch.Tensor, y: torch.Tensor, op: str, alpha: float) -> torch.Tensor:
    if cpu.takes(x):
        return _UNARY[op][1](_acc(dy), _acc(x), _acc(y), alpha).to(x.dtype)
    return kernels.unary_grad(op, dy.contiguous(), x, y, alpha)


@unary_op.register_fake
def _(x, op, alpha):
    return torch.empty_like(x)


@unary_grad_op.register_fake
def _(dy, x, y, op, alpha):
    return torch.empty_like(x)


def _unary_setup(ctx, inputs, output):
    x, op, alpha = inputs
    ctx.save_for_backward(x, output)
    ctx.op, ctx.alpha = op, alpha


def _unary_backward(ctx, dy):
    x, y = ctx.saved_tensors
    return unary_grad_op(dy, x, y, ctx.op, ctx.alpha), None, None


unary_op.register_autograd(_unary_backward, setup_context=_unary_setup)


def unary(op, x, alpha=1.0):
    """``op(x)`` element by element (``op`` one of `sparseblocks.ew.UNARY`), differentiable."""
    return unary_op(x.contiguous(), op, float(alpha))


# -- binary ---------------------------------------------------------------------------


@torch.library.custom_op("sparseblocks::ew_binary", mutates_args=())
def binary_op(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    _check(op, BINARY)
    if cpu.takes(a):
        kernels.api._operands([("a", a), ("b", b)])
        kernels.api.broadcast(tuple(a.shape), tuple(b.shape))
        return _BINARY[op][0](_acc(a), _acc(b)).to(a.dtype)
    return kernels.binary(op, a, b)


@torch.library.custom_op("sparseblocks::ew_binary_grad", mutates_args=())
def binary_grad_op(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> Tuple[torch.Tensor, torch.Tensor]:
    if cpu.takes(a):
        shape = torch.broadcast_shapes(a.shape, b.shape)
        da, db = _BINARY[op][1](_acc(dy), _acc(a).expand(shape), _acc(b).expand(shape))
        return (da.expand(shape).sum_to_size(a.shape).to(a.dtype, copy=True).contiguous(),  # (never dy itself)
                db.expand(shape).sum_to_size(b.shape).to(b.dtype, copy=True).contiguous())
    return kernels.binary_grad(op, dy.contiguous(), a, b)


@binary_op.register_fake
def _(a, b, op):
    return a.new_empty(torch.broadcast_shapes(a.shape, b.shape))


@binary_grad_op.register_fake
def _(dy, a, b, op):
    return torch.empty_like(a), torch.empty_like(b)


def _binary_setup(ctx, inputs, output):
    a, b, op = inputs
    ctx.save_for_backward(a, b)
    ctx.op = op


def _binary_backward(ctx, dy):
    a, b = ctx.saved_tensors
    da, db = binary_grad_op(dy, a, b, ctx.op)
    return da, db, None


binary_op.register_autograd(_binary_backward, setup_context=_binary_setup)


def binary(op, a, b):
    """``op(a, b)`` with broadcasting (``op`` one of `sparseblocks.ew.BINARY`), differentiable."""
    return binary_op(a.contiguous(), b.contiguous(), op)


def _named(table, make):
    return {op: make(op) for op in table}


globals().update(_named(UNARY, lambda op: (lambda x, alpha=1.0: unary(op, x, alpha))))
globals().update(_named(BINARY, lambda op: (lambda a, b: binary(op, a, b))))


# -- add_n, cwise_linear, fused LSTM gates ---------------------------------------------


@torch.library.custom_op("sparseblocks::ew_add_n", mutates_args=())
def add_n_op(xs: List[torch.Tensor]) -> torch.Tensor:
    if xs and cpu.takes(xs[0]):
        kernels.api._operands([(f"xs[{k}]", x) for k, x in enumerate(xs)])
        return sum(_acc(x) for x in xs).to(xs[0].dtype)
    return kernels.add_n(xs)


@add_n_op.register_fake
def _(xs):
    return torch.empty_like(xs[0])


def _add_n_setup(ctx, inputs, output):
    ctx.n = len(inputs[0])


add_n_op.register_autograd(lambda ctx, dy: ([dy] * ctx.n,), setup_context=_add_n_setup)


def add_n(xs):
    """The sum of 1 to 8 tensors in one pass (OpenAI's ``add_n8``), differentiable."""
    return add_n_op([x.contiguous() for x in xs])


@torch.library.custom_op("sparseblocks::ew_cwise_linear", mutates_args=())
def cwise_linear_op(x: torch.Tensor, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> torch.Tensor:
    if cpu.takes(x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = _acc(x)
        y = y * _acc(a).reshape(shape) if a is not None else y
        return (y + _acc(b).reshape(shape) if b is not None else y).to(x.dtype, copy=True)
    return kernels.cwise_linear(x, a, b)


@torch.library.custom_op("sparseblocks::ew_cwise_linear_grad", mutates_args=())
def cwise_linear_grad_op(dy: torch.Tensor, x: torch.Tensor, a: Optional[torch.Tensor]
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if cpu.takes(x):
        axes = (0,) + tuple(range(2, x.dim()))
        g = _acc(dy)
        dx = g * _acc(a).reshape((1, -1) + (1,) * (x.dim() - 2)) if a is not None else g
        return dx.to(x.dtype, copy=True), (g * _acc(x)).sum(dim=axes).to(x.dtype), g.sum(dim=axes).to(x.dtype)
    return kernels.cwise_linear_grad(dy.contiguous(), x, a)


@cwise_linear_op.register_fake
def _(x, a, b):
    return torch.empty_like(x)


@cwise_linear_grad_op.register_fake
def _(dy, x, a):
    return torch.empty_like(x), x.new_empty(x.shape[1]), x.new_empty(x.shape[1])


def _cwise_setup(ctx, inputs, output):
    x, a, b = inputs
    ctx.save_for_backward(x, a)
    ctx.has = (a is not None, b is not None)


def _cwise_backward(ctx, dy):
    x, a = ctx.saved_tensors
    dx, da, db = cwise_linear_grad_op(dy, x, a)
    return dx, da if ctx.has[0] else None, db if ctx.has[1] else None


cwise_linear_op.register_autograd(_cwise_backward, setup_context=_cwise_setup)


def cwise_linear(x, a=None, b=None):
    """``a[c]·x + b[c]`` over axis 1 of x (N, C, ...), differentiable."""
    return cwise_linear_op(x.contiguous(), a, b)


@torch.library.custom_op("sparseblocks::ew_lstm_gates", mutates_args=())
def lstm_gates_op(c: torch.Tensor, gates: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    if cpu.takes(c):
        kernels.api._gate_operands(c, gates)
        i, f, o, u = ([_acc(g) for g in gates] if len(gates) == 4 else _acc(gates[0]).chunk(4, dim=1))
        c_next = torch.sigmoid(f) * _acc(c) + torch.sigmoid(i) * torch.tanh(u)
        return c_next.to(c.dtype), (torch.sigmoid(o) * torch.tanh(c_next)).to(c.dtype)
    return kernels.fused_lstm_gates(c, *gates)


@torch.library.custom_op("sparseblocks::ew_lstm_gates_grad", mutates_args=())
def lstm_gates_grad_op(c: torch.Tensor, gates: List[torch.Tensor], dc_next: torch.Tensor,
                       dh: torch.Tensor) -> List[torch.Tensor]:
    if cpu.takes(c):
        i, f, o, u = ([_acc(g) for g in gates] if len(gates) == 4 else _acc(gates[0]).chunk(4, dim=1))
        cf = _acc(c)
        si, sf, so, tu = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o), torch.tanh(u)
        tc = torch.tanh(sf * cf + si * tu)
        total = _acc(dc_next) + _acc(dh) * so * (1 - tc * tc)
        grads = [total * tu * si * (1 - si), total * cf * sf * (1 - sf), _acc(dh) * tc * so * (1 - so),
                 total * si * (1 - tu * tu)]
        grads = grads if len(gates) == 4 else [torch.cat(grads, dim=1)]
        return [(total * sf).to(c.dtype)] + [g.to(c.dtype) for g in grads]
    return list(kernels.fused_lstm_gates_grad(c, *gates, dc_next=dc_next.contiguous(), dh=dh.contiguous()))


@lstm_gates_op.register_fake
def _(c, gates):
    return torch.empty_like(c), torch.empty_like(c)


@lstm_gates_grad_op.register_fake
def _(c, gates, dc_next, dh):
    return [torch.empty_like(c)] + [torch.empty_like(g) for g in gates]


def _lstm_setup(ctx, inputs, output):
    c, gates = inputs
    ctx.save_for_backward(c, *gates)


def _lstm_backward(ctx, dc_next, dh):
    c, *gates = ctx.saved_tensors
    dc_next = torch.zeros_like(c) if dc_next is None else dc_next
    dh = torch.zeros_like(c) if dh is None else dh
    dc, *dgates = lstm_gates_grad_op(c, gates, dc_next, dh)
    return dc, dgates


lstm_gates_op.register_autograd(_lstm_backward, setup_context=_lstm_setup)


def fused_lstm_gates(c, *gates):
    """OpenAI's ``fused_lstm_gates``: (c_next, h) from c (N, H) and the gates' pre-activations, four
    (N, H) tensors i, f, o, u or one (N, 4H); differentiable."""
    return lstm_gates_op(c.contiguous(), [g.contiguous() for g in gates])


# -- dropout -----------------------------------------------------------------------------


def _cpu_dropout(x, keep_prob, seed, offset):
    from ..philox import keep_bits_host

    kernels.api._dropout_settings(keep_prob, seed, offset)  # (the kernels' checks and errors)
    keep = torch.from_numpy(keep_bits_host(x.numel(), keep_prob, seed, offset)).reshape(x.shape)
    return torch.where(keep, _acc(x) / keep_prob, torch.zeros((), dtype=_acc(x).dtype)).to(x.dtype)


@torch.library.custom_op("sparseblocks::ew_dropout", mutates_args=())
def dropout_op(x: torch.Tensor, keep_prob: float, seed: int, offset: int) -> torch.Tensor:
    if cpu.takes(x):
        return _cpu_dropout(x, keep_prob, seed, offset)
    return kernels.dropout(x, keep_prob, seed, offset)


@dropout_op.register_fake
def _(x, keep_prob, seed, offset):
    return torch.empty_like(x)


def _dropout_setup(ctx, inputs, output):
    _, ctx.keep_prob, ctx.seed, ctx.offset = inputs


def _dropout_backward(ctx, dy):  # (the mask regenerated from seed and offset: nothing was saved)
    return dropout_op(dy.contiguous(), ctx.keep_prob, ctx.seed, ctx.offset), None, None, None


dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup)


def dropout(x, keep_prob=0.8, seed=0, offset=0):
    """OpenAI's ``dropout`` on Philox bits, differentiable: the backward regenerates the mask from
    ``seed`` and ``offset`` (give each call its own offset, e.g. a step count times x.numel())."""
    return dropout_op(x.contiguous(), float(keep_prob), int(seed), int(offset))
