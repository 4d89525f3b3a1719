"""Kept plans of the matmul's products and weight gradient (`runtime.plans`).

A product's plan allocates the output and rewrites three pointers of the recorded launch, after
replaying the transposed copy of W (`BsmmConfig.v5_transposed_forward`) into a fresh scratch
array where the call made one. Where the layout's lines are cut into segments, it allocates
their workspace too and replays the combining launch after the product; a bias's pointer is
rewritten where the product (or its combining pass) adds it, or in the launch that adds it after.
"""

from ..runtime import arrays as _arrays
from ..runtime import plans
from ..runtime.launch import replay


class _Plan:
    """pre: the copy's launch (wt, w live) and scratch its (shape, torch dtype), or both None;
    combine: the combining launch (out, workspace[, bias] live) and workspace the segments'
    (shape, torch dtype), or both None; post: the launch adding the bias or taking the ReLU
    (out[, bias]), or None.
    ``launch`` takes out, [workspace,] a, w[, bias where it adds it]; ``adds``: whether it does."""
    __slots__ = ("layout", "out_shape", "launch", "pre", "scratch", "combine", "workspace", "post", "adds")

    def __init__(self, layout, out_shape, launch, pre, scratch, combine, workspace, post, adds):
        self.layout, self.out_shape, self.launch, self.pre, self.scratch = layout, out_shape, launch, pre, scratch
        self.combine, self.workspace, self.post, self.adds = combine, workspace, post, adds


def _plan_key(cfg, a, w, a_pointer, w_pointer, layout, feature_axis, transpose_w, version, bias, relu):
    """Everything a product call's checks and launch depend on, for torch tensors a, w (and bias)."""
    return ("bsmm", cfg, id(layout), feature_axis, transpose_w, version, a.dtype, w.dtype, a.shape, w.shape, a.device,
            a_pointer % 16, w_pointer % 16, None if bias is None else (bias.dtype, bias.shape, bias.device), relu)


def replayed_product(cfg, a, w, layout, feature_axis, transpose_w, version, bias=None, relu=False):
    """The product through a kept plan, or None: no plan fits (the general path runs)."""
    if not (isinstance(a, plans.tensor) and isinstance(w, plans.tensor)
            and (bias is None or isinstance(bias, plans.tensor))) or _arrays._poison_outputs:
        return None
    a_pointer, w_pointer = a.data_ptr(), w.data_ptr()
    plan = plans.kept.get(_plan_key(cfg, a, w, a_pointer, w_pointer, layout, feature_axis, transpose_w, version,
                                    bias, relu))
    if plan is None or plan.layout is not layout or not (
            a.is_contiguous() and w.is_contiguous() and (bias is None or bias.is_contiguous())):
        return None
    out = a.new_empty(plan.out_shape)
    stream = _arrays.torch_stream_handle()
    if plan.pre is not None:
        wt = a.new_empty(plan.scratch[0], dtype=plan.scratch[1])
        plan.pre(stream, wt.data_ptr(), w_pointer)
        w_pointer = wt.data_ptr()
    fused = (bias.data_ptr(),) if plan.adds else ()
    workspace = None if plan.combine is None else a.new_empty(plan.workspace[0], dtype=plan.workspace[1])
    held = () if workspace is None else (workspace.data_ptr(),)
    if not plan.launch(stream, out.data_ptr(), *held, a_pointer, w_pointer, *fused):
        return None  # (a tensor map could not be made; nothing ran)
    if workspace is not None:
        plan.combine(stream, out.data_ptr(), workspace.data_ptr(), *fused)
    if plan.post is not None:  # (the bias's pointer where it adds one; a ReLU alone: none)
        plan.post(stream, out.data_ptr(), *(() if bias is None else (bias.data_ptr(),)))
    return out


def keep_product_plan(cfg, a, w, bias, layout, feature_axis, transpose_w, version, out_shape, launched, relu=False):
    """After a general-path product of torch tensors: keep its launches for `replayed_product`."""
    if launched is None or a.kind != "torch" or _arrays._poison_outputs:
        return
    pre, (kernel, grid, threads, args, derived, live), combine, post = launched
    plan = replay(kernel, grid, threads, args, derived, live=live)  # (live: out, [workspace,] a, w[, bias])
    pre_plan = None if pre is None else replay(*pre, live=(0, 1))  # wt, w
    combine_plan = None if combine is None else replay(*combine[:5], live=combine[5])  # out, workspace[, bias]
    post_plan = None if post is None else replay(*post[:5], live=post[5])  # out[, bias]
    if plan is None or any(launch is not None and kept is None
                           for launch, kept in ((pre, pre_plan), (combine, combine_plan), (post, post_plan))):
        return
    import torch

    a_native, w_native = a.native, w.native
    key = _plan_key(cfg, a_native, w_native, a_native.data_ptr(), w_native.data_ptr(), layout, feature_axis,
                    transpose_w, version, None if bias is None else bias.native, relu)
    scratch = None if pre is None else (tuple(pre[3][0].shape), torch.int32)
    workspace = None if combine is None else (tuple(args[1].shape),
                                              torch.float64 if a.dtype == "float64" else torch.float32)
    adds = bias is not None and post is None
    plans.keep(key, _Plan(layout, out_shape, plan, pre_plan, scratch, combine_plan, workspace, post_plan, adds))


# A weight gradient's plan allocates dW (or takes out=) and the N-splits' workspace, and
# replays the gradient's launch and, with splits, the combining one; with the bias gradient, its
# sums' scratch, the column-sum launch and the finishing one after them.
class _WeightGradPlan:
    """workspace: the N-splits' (shape, torch dtype), or None (one split, one launch); sums: None,
    or (the fused sums' shape or None, the column-sum launch and its parts' (shape, dtype) or
    both None, the finishing launch, db's torch dtype)."""
    __slots__ = ("layout", "workspace", "main", "combine", "dtype", "sums")

    def __init__(self, layout, workspace, main, combine, dtype, sums=None):
        self.layout, self.workspace, self.main, self.combine, self.dtype = layout, workspace, main, combine, dtype
        self.sums = sums


def _weight_grad_key(cfg, x, dy, out, layout, feature_axis, beta, version, splits, out_dtype, dbias_dtype=None):
    """Everything a weight-gradient call's checks and launches depend on (torch tensors), or None."""
    if not isinstance(beta, (int, float)) or not (splits is None or isinstance(splits, int)) or not all(
            dtype is None or isinstance(dtype, str) for dtype in (out_dtype, dbias_dtype)):
        return None
    return ("bsmm weight_grad", cfg, id(layout), feature_axis, float(beta), version, splits, out_dtype, x.dtype,
            dy.dtype, x.shape, dy.shape, x.device, x.data_ptr() % 16, dy.data_ptr() % 16,
            None if out is None else (out.dtype, out.shape, out.device, out.data_ptr() % 16), dbias_dtype)


def replayed_weight_grad(cfg, x, dy, layout, feature_axis, out, beta, version, splits, out_dtype=None,
                         dbias_dtype=None):
    """The weight gradient (with ``dbias_dtype``, and the bias gradient: a pair) through a kept
    plan, or None: no plan fits (the general path runs)."""
    if not (isinstance(x, plans.tensor) and isinstance(dy, plans.tensor)
            and (out is None or isinstance(out, plans.tensor))) or _arrays._poison_outputs:
        return None
    key = _weight_grad_key(cfg, x, dy, out, layout, feature_axis, beta, version, splits, out_dtype, dbias_dtype)
    plan = plans.kept.get(key) if key is not None else None
    if plan is None or plan.layout is not layout or not (
            x.is_contiguous() and dy.is_contiguous() and (out is None or out.is_contiguous())) or (
            out is not None and _arrays.tensors_overlap(out, (x, dy))):
        return None  # (the general path checks an out= sharing memory with x or dy, and raises)
    dw = (x.new_empty(layout.w_shape, dtype=plan.dtype) if out is None else out)
    stream = _arrays.torch_stream_handle()
    fused = ()
    if plan.sums is not None and plan.sums[0] is not None:
        import torch

        sums = x.new_empty(plan.sums[0], dtype=torch.float32)
        fused = (sums.data_ptr(),)
    if plan.combine is None:
        if not plan.main(stream, dw.data_ptr(), x.data_ptr(), dy.data_ptr(), *fused):
            return None  # (a tensor map could not be made; nothing ran)
    else:
        workspace = x.new_empty(plan.workspace[0], dtype=plan.workspace[1])
        if not plan.main(stream, dw.data_ptr(), workspace.data_ptr(), x.data_ptr(), dy.data_ptr(), *fused):
            return None
        plan.combine(stream, dw.data_ptr(), workspace.data_ptr())
    if plan.sums is None:
        return dw
    _, column, parts_as, finish, db_dtype = plan.sums
    held = ()
    if column is not None:
        parts = x.new_empty(parts_as[0], dtype=parts_as[1])
        column(stream, parts.data_ptr(), dy.data_ptr())
        held = (parts.data_ptr(),)
    db = x.new_empty((layout.dense_shape[1],), dtype=db_dtype)
    finish(stream, db.data_ptr(), *fused, *held)
    return dw, db


def keep_weight_grad_plan(cfg, x, dy, out, layout, feature_axis, beta, version, splits, launched, given_dtype,
                          out_dtype, dbias_dtype=None):
    """After a general-path weight gradient of torch tensors: keep its launches (keyed on the call's
    ``out_dtype`` as given, dW made in ``out_dtype`` as resolved; ``dbias_dtype``: the bias
    gradient's dtype, or None)."""
    if launched is None or x.kind != "torch" or _arrays._poison_outputs:
        return
    main, combine, workspace, sums = launched
    import torch

    key = _weight_grad_key(cfg, x.native, dy.native, None if out is None else out.native, layout, feature_axis, beta,
                           version, splits, given_dtype, dbias_dtype)
    if key is None:
        return
    fused = () if sums is None or sums[0] is None else (8,)  # (version 7's sums argument)
    kept = (replay(*main, live=((0, 2, 3) if combine is None else (0, 1, 2, 3)) + fused),
            None if combine is None else replay(*combine, live=(0, 1)))
    if kept[0] is None or (combine is not None and kept[1] is None):
        return
    kept_sums = None
    if sums is not None:
        fused_shape, column, parts_as, finish = sums
        column_plan = None if column is None else replay(*column, live=(0, 1))
        finish_plan = replay(*finish[:5], live=finish[5])
        if finish_plan is None or (column is not None and column_plan is None):
            return
        parts_as = None if parts_as is None else (parts_as[0], torch.float64 if parts_as[1] == "float64"
                                                  else torch.float32)
        kept_sums = (fused_shape, column_plan, parts_as, finish_plan, getattr(torch, dbias_dtype))
    workspace = None if workspace is None else (workspace, torch.float64 if x.dtype == "float64" else torch.float32)
    plans.keep(key, _WeightGradPlan(layout, workspace, *kept, getattr(torch, out_dtype), kept_sums))
