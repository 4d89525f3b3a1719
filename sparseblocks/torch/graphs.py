"""CUDA graphs of a `SparseResBlock`'s residual and its backward (``graphs=True``).

A graph is captured once per signature (windows' geometry, shapes, dtypes) into
buffers of its own capacity (`_Slot`), and replayed with the call's tensors
copied in; gathers, scatters and the fused products go through the kept
launches of `sparseblocks.sbnet` and `sparseblocks.fused` directly.
"""

import torch

from .. import fused as fused_kernels
from .. import sbnet as kernels
from ..runtime.arrays import torch_stream_handle
from .bottleneck import (
    _after_first_product,
    _bottleneck_nchw,
    _bottleneck_nchw_backward,
    _bottleneck_nchw_image_backward,
    _bottleneck_nchw_nhwc_out,
    _bottleneck_nhwc,
    _bottleneck_nhwc_backward,
    _first_relu,
    _fuses_gather,
    _fuses_scatter,
    _nchw_first_relu,
    _second_relu,
    _WrittenOut,
)


class _Traced:
    """Any residual (a subclass's), differentiated by autograd: its graph is built in the
    forward (``keep``) and run in the backward."""

    def __init__(self, residual):
        self.residual = residual

    @staticmethod
    def flips(windows):  # (autograd's backward takes the gradient in the output's layout)
        return False

    @staticmethod
    def flips_output(windows):  # (the subclass's residual gives its stack's layout)
        return False

    nhwc_output = flips_output

    def forward(self, stack, params, keep, flipped=False):  # (never flipped: see `flips`)
        if not keep:
            return self.residual(stack), None
        with torch.enable_grad():
            out = self.residual(stack.requires_grad_(True))
        return out.detach(), (stack, out)

    @staticmethod
    def backward(saved, params, grad_out, needs, flipped=False):  # (never flipped: see `flips`)
        stack, out = saved
        wanted = [t for t, need in zip((stack, *params), needs) if need]
        # (retained: autograd frees `out`, and with it this graph, once the block's node is spent)
        found = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True, retain_graph=True))
        return tuple(next(found) if need else None for need in needs)


_WRITTEN_OUT = {False: _WrittenOut(_bottleneck_nhwc, _bottleneck_nhwc_backward, _first_relu),
                True: _WrittenOut(_bottleneck_nchw, _bottleneck_nchw_backward, _nchw_first_relu,
                                  _bottleneck_nchw_nhwc_out, _bottleneck_nchw_image_backward)}  # by NCHW stack


def _capacity(n):
    """Rows of the stack a graph is captured for: ``n`` windows rounded up to a multiple of 8
    up to 128, above to a sixteenth of n's power of two (at most 1/16 of the rows wasted above
    128; sixteen graphs an octave: coarser steps waste enough rows to slow device-bound calls)."""
    if n <= 128:
        return -(-n // 8) * 8
    step = 1 << (n.bit_length() - 5)
    return -(-n // step) * step


def _rows_like(t, rows):
    """Zeros of ``rows`` rows, each shaped and laid out as t's rows are (channels_last kept)."""
    channels_last = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format).zero_()


def _captured(fn, pool):
    """A CUDA graph of ``fn()`` in the memory pool `pool`, and what fn returned in the capture,
    after one run on a side stream (cuBLAS and cuDNN choose and allocate outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


def _signature(windows, image, inplace):
    """Everything the public gather and scatter check, or their kept plans depend on, that a
    slot does not fix (the image contiguous: the block's forward made it so)."""
    indices, count = windows.indices, windows.count
    return (image.shape, image.data_ptr() % 16, indices.shape, indices.dtype, indices.get_device(),
            indices.is_contiguous(), indices.data_ptr() % 16,
            count is None or (count.shape, count.dtype, count.get_device()), inplace, windows.transpose,
            windows.data_format, windows.gather_at, windows.scatter_at)


class _Slot:
    """Buffers for `rows` windows and the CUDA graphs of a residual captured on their first rows.

    The stack (the gather writes it), the residual's output (the scatter reads
    it), both ReLUs' outputs (the backward reads them) and, once a training
    call has come, the output's and the stack's gradients. Every tensor that
    outlives a graph's replay lives in these buffers (`into`), so the graphs
    of all capacities share them, and what the graphs allocate is spent
    within one replay: all of them share one memory pool (they replay one at
    a time, in one stream's order). A graph of a capacity runs all its rows:
    those past a call's count hold an earlier call's windows (see `_Lease`).
    """

    def __init__(self, residual, weights, image, stack_shape, rows, flip=(False, False)):
        # flip: (whether the backward's gradients are in the image's layout, whether the forward's
        # output is NHWC though the stack is NCHW)
        self.residual, self.weights, self.rows = residual, weights, rows
        self.flip, self.flip_out = flip
        self.stream = torch_stream_handle()  # (its key's: a slot serves one stream)
        self.stack = image.new_zeros((rows, *stack_shape))
        # (each row's shape and layout)
        out, (_, h1, h2) = residual.forward(self.stack[:2], weights, flipped=self.flip_out)
        self.h1, self.h2, self.out = _rows_like(h1, rows), _rows_like(h2, rows), _rows_like(out.contiguous(), rows)
        self.grad_out = self.grad_stack = None
        self.pool = torch.cuda.graph_pool_handle()
        self.forwards, self.backwards, self.launches = {}, {}, {}
        self.busy, self.generation = False, 0

    def round_trip(self, windows, image, inplace, capacity, zero_rest, needs=None):
        """Windows of `image` gathered into the slot, a graph of `capacity` rows replayed, its
        result added back into a copy of `image` (or into it, `inplace`); `zero_rest`: the
        gathered rows from the windows' to the capacity zeroed first.

        Without `needs`, the residual's forward: gathered at the input windows into the stack,
        its output added at the output windows; returns (y, None). With `needs` (the flags of
        `_WrittenOut.backward`), its backward: the output gradient `image` gathered at the output
        windows, the stack's gradient added atomically at the input windows where ``needs[0]``
        asks for it; returns (that or None, the graph's gradients). A signature seen before
        (`_signature`) launches the kept gather (or fused gather and product) and scatter (or
        fused product and scatter) directly (`kernels.kept_launches`, `gather_matmul.kept_launch`,
        `kept_scatter_launch`): an eager call of a sparse block is bound by the host's time, and
        the device waits for the first launch."""
        backward = needs is not None
        n, indices, count = len(windows.indices), windows.indices, windows.count
        # (None: the windows' own. A flipped backward takes and gives its gradients in the image's
        # layout, without the transpose; an output flipped NHWC goes back through the transpose where
        # the image is NCHW, without it where it is NHWC: `_Windows.out_transpose`.)
        transpose = False if backward and self.flip else None
        scatter_transpose = (False if self.flip else None) if backward else windows.out_transpose(self.flip_out)
        source, result = (self.grad_out, self.grad_stack) if backward else (self.stack, self.out)
        gather_at, scatter_at = (windows.scatter_at, windows.gather_at) if backward else (
            windows.gather_at, windows.scatter_at)
        # Without gradients the gather may go straight into the first product (`_fuses_gather`):
        # no stack, and a graph from the first ReLU's output on; in place, the last product
        # straight into the image (`_fuses_scatter`): a graph up to the second ReLU's output. A
        # signature seen before knows (training calls, `zero_rest`, keep the stack: their backward
        # reads it).
        key = (_signature(windows, image, inplace), backward, zero_rest, windows.config)
        kept = self.launches.get(key)
        if kept is not None:
            fused, fused_last = kept[4:]
        else:
            plain = not (backward or zero_rest) and self.residual.nhwc_output(windows)
            fused = plain and _fuses_gather(windows, image, self.weights[0])
            fused_last = plain and inplace and _fuses_scatter(windows, image, self.h2, self.weights[2])
        if fused_last:
            result = self.h2
        stream = self.stream if kept else None
        if fused and kept:
            kept[0](stream, self.h1.data_ptr(), image.data_ptr(), self.weights[0].data_ptr(), indices.data_ptr(),
                    kept[2] or count.data_ptr())
        elif fused:
            windows.gather_matmul(image.detach(), self.weights[0], out=self.h1[:n])
        elif kept:
            kept[0](stream, image.data_ptr(), source.data_ptr(), indices.data_ptr(), kept[2] or count.data_ptr())
        else:
            windows.gather(image.detach(), at=gather_at, out=source[:n], transpose=transpose)
        if zero_rest and n < capacity:
            source[n:capacity].zero_()
        if backward:
            graph, outputs = self.backward(capacity, needs)
        else:
            graph, outputs = self.forward(capacity, fused, fused_last), None
        graph.replay()
        if backward and not needs[0]:
            return None, outputs
        if kept:
            return kept[1](stream, image, result.data_ptr(), indices.data_ptr(), kept[3] or count.data_ptr()), outputs
        if fused_last:
            y = windows.matmul_scatter(self.h2[:n], self.weights[2], image)
        else:
            y = windows.scatter(result[:n], image, inplace, atomic=backward, at=scatter_at,
                                transpose=scatter_transpose)
        kept = kernels.kept_launches(image, indices, result[:n], count, *gather_at,
                                     windows.transpose if transpose is None else transpose,
                                     windows.data_format, inplace, scatter_at, atomic=backward, gather=not fused,
                                     scatter=not fused_last,
                                     scatter_transpose=windows.transpose if scatter_transpose is None
                                     else scatter_transpose)
        if kept is not None and fused:  # the fused gather's kept launch in the gather's place
            first = fused_kernels.kept_launch(image, indices, self.weights[0], count, *gather_at, relu=True,
                                              data_format=windows.data_format)
            kept = None if first is None else (first[0], kept[1], first[1], kept[3])
        if kept is not None and fused_last:  # and the fused product and scatter's in the scatter's
            last = fused_kernels.kept_scatter_launch(self.h2[:n], indices, self.weights[2], image, count, *scatter_at,
                                                     data_format=windows.data_format)
            kept = None if last is None else (kept[0], _adding_into(last[0], self.weights[2]), kept[2], last[1])
        if kept is not None:
            self.launches[key] = (*kept, fused, fused_last)
        return y, outputs

    def forward(self, capacity, fused=False, fused_last=False):
        """The residual's graph on the first `capacity` rows (`fused`: from the first ReLU's
        output, which the fused gather and product wrote, on; `fused_last`: up to the second
        ReLU's output, which the fused product and scatter read)."""
        graph = self.forwards.get((capacity, fused, fused_last))
        if graph is None:
            c = capacity
            w1, w2, w3 = self.weights
            if fused_last:
                def run():
                    h1 = self.h1[:c] if fused else self.residual.first(self.stack[:c], w1, self.h1[:c])
                    _second_relu(h1, w2, self.h2[:c])
            elif fused:
                def run():
                    _after_first_product(self.h1[:c], w2, w3, into=(None, self.h2[:c], self.out[:c]))
            else:
                def run():
                    self.residual.forward(self.stack[:c], self.weights, into=(self.h1[:c], self.h2[:c], self.out[:c]),
                                          flipped=self.flip_out)
            graph = self.forwards[(c, fused, fused_last)] = _captured(run, self.pool)[0]
        return graph

    def backward(self, capacity, needs):
        """The residual's backward's graph on the first `capacity` rows, for the gradients `needs`
        asks for, and its outputs (the stack's gradient a view of `grad_stack`)."""
        found = self.backwards.get((capacity, needs))
        if found is None:
            if self.grad_out is None:  # (flipped: NHWC, from the NCHW stack's shape; the output's by its own)
                out, stack = self.out, self.stack
                self.grad_out = torch.zeros_like(out) if self.flip == self.flip_out else out.new_zeros(
                    out.permute(*((0, 2, 3, 1) if self.flip else (0, 3, 1, 2))).shape)
                self.grad_stack = stack.new_zeros(stack.permute(0, 2, 3, 1).shape) if self.flip else \
                    torch.zeros_like(stack)
            c = capacity
            saved = (self.stack[:c], self.h1[:c], self.h2[:c])
            found = self.backwards[(c, needs)] = _captured(lambda: self.residual.backward(
                saved, self.weights, self.grad_out[:c], needs, into=self.grad_stack[:c], flipped=self.flip), self.pool)
        return found


def _adding_into(launch, weight):
    """A kept `sparse_matmul_scatter` launch (`gather_matmul.kept_scatter_launch`) called as
    `kernels.kept_launches`' scatters are: ``(stream handle, image, blocks, indices, count)`` ->
    the image, added into in place (the weight: the slot's own, whose address is in its key)."""
    pointer = weight.data_ptr()

    def scatter(stream, image, blocks, indices, count):
        launch(stream, image.data_ptr(), blocks, pointer, indices, count)
        return image

    return scatter


class _Lease:
    """A slot held for one training call, from its forward to the end of its backward (or until
    its autograd node is gone, with no backward run).

    Rows past the call's count enter the weights' gradients (sums over every
    row the graphs run), so they are zeroed in the stack and in the output's
    gradient: zeros add nothing, where an earlier call's windows would, and an
    earlier call's overflow (inf) would make NaN of them.
    """

    def __init__(self, slot, capacity, n, needs):
        self.slot, self.capacity, self.n, self.needs = slot, capacity, n, needs
        self.generation = slot.generation
        slot.forward(capacity)
        slot.backward(capacity, needs)  # (captured now: not on autograd's thread, mid-backward)

    def forward(self, windows, image, inplace):
        """`image` plus the residual of its windows (`_Slot.round_trip`)."""
        return self.slot.round_trip(windows, image, inplace, self.capacity, zero_rest=True)[0]

    def backward(self, windows, grad_y):
        """Gradients of (image, w1, w2, w3) for those `needs` asks for (None for the others):
        the image's is grad_y plus the stack's gradient added atomically at the input windows
        (into a copy of grad_y)."""
        slot = self.slot
        if slot.generation != self.generation:
            raise RuntimeError("SparseResBlock(graphs=True): a later call has overwritten what this backward "
                               "reads (a second backward through one forward needs graphs=False)")
        grad_image, grads = slot.round_trip(windows, grad_y, False, self.capacity, zero_rest=True, needs=self.needs)
        # The weights' gradients are copied: autograd may keep what it is given (as .grad), and
        # the next replay overwrites the graph's own.
        grads = (grad_image, *(None if g is None else g.clone() for g in grads[1:]))
        self.release()  # (all that reads the slot's buffers is queued: stream order does the rest)
        return grads

    def release(self):
        if self.slot.generation == self.generation:
            self.slot.busy = False

    __del__ = release


class _ResidualGraphs:
    """CUDA graphs of a block's residual (a `_WrittenOut`) and of its backward.

    A graph is captured per capacity (`_capacity` of the window count) on the
    first rows of a slot's buffers (`_Slot`) and replayed for every count up
    to it: the gather writes the count's windows into the slot's stack
    (``sparse_gather(out=)``), the graph runs the residual on all the
    capacity's rows, the scatter reads the count's rows of its output. A
    training call holds its slot until its backward has run (`_Lease`); a
    call without gradients until its scatter is queued. Slots per dtype,
    device, stack shape, stream and weights (their addresses: the graphs read
    the weights' memory, so in-place updates are seen; new weight tensors get
    new slots and free the old), at most MAX_SLOTS held at once (beyond, calls
    run without graphs); a slot too small for a count is replaced by one of
    twice its rows (or the count's capacity), its graphs captured anew.
    """

    MAX_SLOTS = 4

    def __init__(self):
        self._sets = {}

    def __deepcopy__(self, memo):  # (graphs and their buffers belong to the original module)
        return _ResidualGraphs()

    def __getstate__(self):
        return {"_sets": {}}

    def _acquire(self, residual, weights, image, stack_shape, flip, n):
        """(a free slot of the key's with room for n windows, marked held, the capacity), or
        (None, capacity) when MAX_SLOTS are held."""
        capacity = _capacity(n)
        pointers = tuple(w.data_ptr() for w in weights)
        key = (image.dtype, image.device, stack_shape, flip, torch_stream_handle(), residual, pointers)
        slots = self._sets.get(key)
        if slots is None:  # (held slots of dropped keys live on in their leases)
            self._sets = {k: v for k, v in self._sets.items() if k[-1] == pointers}
            slots = self._sets[key] = []
        slot = next((s for s in slots if not s.busy), None)
        if slot is None or slot.rows < capacity:
            if slot is None and len(slots) >= self.MAX_SLOTS:
                return None, capacity
            rows = capacity if slot is None else max(capacity, 2 * slot.rows)
            if slot is not None:
                slots.remove(slot)
            slot = _Slot(residual, weights, image, stack_shape, rows, flip)
            slots.append(slot)
        slot.busy = True
        slot.generation += 1
        return slot, capacity

    def run(self, residual, weights, windows, image, inplace, stack_shape, flip):
        """A call without gradients through the graphs, or None (then it runs without).

        Rows past the windows' hold an earlier call's: computed, never scattered.
        """
        slot, capacity = self._acquire(residual, weights, image, stack_shape, flip, len(windows.indices))
        if slot is None:
            return None
        try:
            return slot.round_trip(windows, image, inplace, capacity, zero_rest=False)[0]
        finally:
            slot.busy = False

    def lease(self, residual, weights, image, stack_shape, flip, n, needs):
        """A `_Lease` for a training call, or None (then it runs without graphs)."""
        slot, capacity = self._acquire(residual, weights, image, stack_shape, flip, n)
        return None if slot is None else _Lease(slot, capacity, n, needs)
