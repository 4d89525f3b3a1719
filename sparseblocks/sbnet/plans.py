"""Kept plans of the gathers, scatters and reduce_mask (`runtime.plans`).

A plan allocates the outputs and rewrites the pointers of the recorded launches
(`runtime.launch.Replay`). `kept_launches` hands a caller that repeats a gather
and an adding scatter (the torch layer's CUDA graphs) the launches themselves.
"""

import functools

from ..runtime import arrays as _arrays_module
from ..runtime import plans
from ..runtime.launch import data_pointer, replay
from .config import as_config
from .statuses import _statuses


class _Plan:
    """out_shape: the output's; extra: the device count's pointer (gathers and scatters without
    a count), or reduce_mask's (windows, chunks); launch: the replays, in order; buffers: a
    merging scatter's (window map, chain) sizes (int32 entries, one buffer), else None."""
    __slots__ = ("out_shape", "extra", "launch", "buffers")

    def __init__(self, out_shape, extra, launch, buffers=None):
        self.out_shape, self.extra, self.launch, self.buffers = out_shape, extra, launch, buffers


def _plan_key(call, tensors, count, settings):
    """Everything a call's checks and launch depend on, or None (not torch tensors, or settings
    that are not hashable)."""
    if not all(isinstance(t, plans.tensor) for t in tensors) or not (
            count is None or isinstance(count, plans.tensor)) or _arrays_module._poison_outputs:
        return None
    try:
        hash(settings)
    except TypeError:  # e.g. a list for bsize
        return None
    key = ["sbnet " + call, settings, tensors[0].device, count is None or (count.shape, count.dtype)]
    for t in tensors:
        key += (t.shape, t.dtype, t.data_ptr() % 16)
    return tuple(key)


def find_plan(call, tensors, count, settings):
    """The kept plan for a call of contiguous torch tensors, or None."""
    key = _plan_key(call, tensors, count, settings)
    plan = plans.kept.get(key) if key is not None else None
    if plan is None or not all(t.is_contiguous() for t in tensors):
        return None
    return plan


def replayed(call, tensors, count, settings, inplace=False, out=None):
    """The call through its kept plan: a gather into a new tensor (or ``out``), a scatter into y
    itself (``inplace``) or into a copy of it; None where no plan fits (the general path runs
    and checks)."""
    plan = find_plan(call, tensors, count, settings)
    if plan is None:
        return None
    # (the general path raises where what the call writes shares memory with what it reads)
    if call != "gather":
        if inplace and _arrays_module.tensors_overlap(tensors[2], (*tensors[:2], count)):
            return None
    elif out is not None and not (
            isinstance(out, plans.tensor) and out.shape == plan.out_shape and out.dtype == tensors[0].dtype
            and out.device == tensors[0].device and out.is_contiguous()
            and not _arrays_module.tensors_overlap(out, (*tensors, count))):
        return None
    stream = _arrays_module.torch_stream_handle()
    count = plan.extra if count is None else count.data_ptr()
    if call != "gather":
        return scatter_replay(plan, stream, tensors[2], tensors[0].data_ptr(), tensors[1].data_ptr(), count, inplace)
    if out is None:
        out = tensors[0].new_empty(plan.out_shape)
    plan.launch[0](stream, tensors[0].data_ptr(), out.data_ptr(), tensors[1].data_ptr(), count)
    return out


def scatter_replay(plan, stream, y, blocks, indices, count, inplace):
    """A scatter through its kept plan: into ``y`` (``inplace``), into a copy of it, or merged
    into a new tensor (the plan's buffers); ``blocks``, ``indices``, ``count``: pointers."""
    if plan.buffers is None:
        out = y if inplace else y.clone()
        plan.launch[0](stream, out.data_ptr(), blocks, indices, count)
        return out
    import torch

    out = torch.empty_like(y)
    windows, rows = plan.buffers
    # (freed once the launches are queued: stream order keeps it until they have run)
    scratch = torch.empty(windows + rows, dtype=torch.int32, device=y.device)
    slots = scratch.data_ptr()
    chain = slots + 4 * windows
    if len(plan.launch) == 3:
        plan.launch[0](stream, slots)
    plan.launch[-2](stream, slots, chain, indices, count)
    plan.launch[-1](stream, out.data_ptr(), y.data_ptr(), blocks, slots, chain)
    return out


def replayed_reduce(mask, settings):
    """reduce_mask through its kept plan: (indices, count) as new tensors; None where no plan fits."""
    plan = find_plan("reduce", (mask,), None, settings)
    if plan is None:
        return None
    import torch

    device = mask.device
    indices = torch.empty(plan.out_shape, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    stream = _arrays_module.torch_stream_handle()
    if plan.extra[0] == "pass":  # version 2: one launch on zeroed statuses
        status = _statuses(plan.extra[1], stream)
        status = data_pointer(status) if status is not None else \
            torch.zeros(plan.extra[1], dtype=torch.int64, device=device).data_ptr()
        plan.launch[0](stream, indices.data_ptr(), count.data_ptr(), status, mask.data_ptr())
        return indices, count
    _, total, n_chunks = plan.extra
    flags = torch.empty(total, dtype=torch.int8, device=device)
    chunk_counts = torch.zeros(n_chunks, dtype=torch.int32, device=device)
    pool, write = plan.launch
    pool(stream, flags.data_ptr(), chunk_counts.data_ptr(), mask.data_ptr())
    write(stream, indices.data_ptr(), count.data_ptr(), flags.data_ptr(), chunk_counts.data_ptr(),
          chunk_counts.data_ptr())
    return indices, count


def gather_settings(cfg, bsize, bstride, boffset, transpose, data_format):
    return cfg, bsize, bstride, boffset, bool(transpose), data_format


def scatter_settings(cfg, bsize, bstride, boffset, add, atomic, transpose, inplace, data_format):
    return cfg, bsize, bstride, boffset, bool(add), bool(atomic), bool(transpose), bool(inplace), data_format


def kept_launches(x, indices, blocks, count, bsize, bstride, boffset, transpose, data_format, inplace,
                  scatter_at=None, atomic=False, gather=True, scatter=True, scatter_transpose=None, config=None):
    """The kept launches of a gather of ``x`` and an adding scatter back into it (atomic or not;
    at the same geometry, or at ``scatter_at`` = (bsize, bstride, boffset); through the transpose
    as the gather, or as ``scatter_transpose`` says where given), both called once
    before with these tensors (``blocks``: the scatter's; the gather's ``out`` is of the same
    rows), or None. For a caller that repeats such a pair many times with its own buffers
    (`sparseblocks.torch`'s CUDA graphs): ``gather(stream handle, image, blocks, indices, count)``,
    pointers all, and ``scatter(stream handle, image, blocks, indices, count)``, the image a
    tensor, the rest pointers, returning the output (the image itself where ``inplace``), skip
    even the kept plans' lookups. Returns (gather, scatter, gather's count pointer, scatter's
    count pointer); a count pointer is None where the caller's ``count`` is to be passed.
    Without ``gather`` (a caller that gathers otherwise) the gather's launch and count pointer
    are None and only the scatter need have been called; without ``scatter`` likewise."""
    if not plans.kept:
        return None
    cfg = as_config(config)
    kept = added = None
    if gather:
        kept = find_plan("gather", (x, indices), count, gather_settings(cfg, bsize, bstride, boffset, transpose, data_format))
    if scatter:
        at = scatter_at or (bsize, bstride, boffset)
        added = find_plan("scatter", (blocks, indices, x), count,
                      scatter_settings(cfg, *at, True, atomic,
                                        transpose if scatter_transpose is None else scatter_transpose,
                                        inplace, data_format))
    if (gather and kept is None) or (scatter and added is None):
        return None
    extra = (kept and kept.extra, added and added.extra) if count is None else (None, None)
    return kept and kept.launch[0], added and functools.partial(scatter_replay, added, inplace=inplace), *extra


def keep_plan(call, tensors, count, settings, out_shape, launches, extra, buffers=None):
    """After a general-path call of torch tensors: keep its launches for `replayed` (launches:
    (a launch as `_launch.replay` takes it, the positions of its pointer arguments) pairs;
    extra, buffers: see `_Plan`)."""
    if _arrays_module._poison_outputs or not hasattr(tensors[0], "data_ptr"):
        return  # (data_ptr: a torch tensor; callers of other kinds need not have torch installed)
    plans.watch_torch()
    key = _plan_key(call, tensors, count, settings)
    kept = [replay(*launched, live=live) for launched, live in launches] if key is not None else [None]
    if None in kept:
        return
    plans.keep(key, _Plan(out_shape, extra, kept, buffers))
