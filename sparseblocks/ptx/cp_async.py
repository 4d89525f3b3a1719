"""Asynchronous global-to-shared copies (cp.async) and the waits for them.

``copy16(shared, (i, ..., j), source, (k, ..., l))`` starts a 16-byte copy of
``source[k, ..., l:]`` into ``shared[i, ..., j:]`` (``cp.async.cg.shared.global``:
through L2 only, no register holds the data); ``commit()`` closes this
thread's group of copies started since the last commit; ``wait_all()`` and
``wait_but_one()`` (``cp.async.wait_group 0`` / ``1``) block this thread until
all its groups, or all but the newest one, have landed; ``waiter(n)`` is the
wait that leaves the newest ``n`` groups (0 to 3) in flight; ``make_ring(issue, stages,
stage_bytes)`` runs a ring of stages over them (the protocol of every pipeline here).

``copy16`` works out both addresses from array indices at every call, which
costs a kernel that copies a tile's rows every stage some 30 instructions a
copy (64-bit index products, the generic-to-shared conversion). Kernels
that copy from the same places stage after stage instead take the addresses
once, ``shared_address(shared, (i, ...))`` (32-bit, in the shared window) and
``global_address(source, (k, ...))`` (64-bit; ``signed_address`` gives it as an int64, so
that signed int64 offsets add to it: Numba types uint64 + int64 as a float), add byte offsets to them, and
call ``copy16_to(shared_address, global_address)``: one instruction and two
additions a copy. ``copy16_or_zero(shared_address, global_address, keep)``
writes 16 zero bytes instead where ``keep`` is false (cp.async's source size
0: nothing is read), for rows past an array's end (``copy8_or_zero`` and
``copy4_or_zero`` the same for 8 and 4 bytes, ``cp.async.ca``: a block-sparse
list's blocks of 2 or 1 words); its source address is still
kept inside the array (the simulator checks it), as a faulting address could fault. Other threads see a
landed copy only after a barrier, as with any shared store. Both addresses
must be multiples of 16 bytes and the 16 bytes contiguous: launchers check
pointers and strides on the host, as for `_vector.py`'s loads.

This is what lets a kernel keep several stages of a tile in flight without
holding them in registers (CUTLASS's multistage pipelines). Numba exposes
no such instruction, so the compiled functions are intrinsics that emit
inline PTX: the shared address is the generic pointer of the element,
converted with ``cvta.to.shared``.

In the CUDA simulator each thread's copies wait in a per-thread queue and
land at the wait that covers them, not when started: a kernel that reads a
stage before waiting for it reads stale shared memory there too, so the
simulator tests catch a missing wait. Unaligned addresses raise, and so do
addresses (array plus byte offset, there) past either array's end.

Used by version 5's fp32 weight gradient (kernels/bsmm.py, V5_WGRAD_ASYNC)
and its products' stage ring (V5_STAGES > 2, the default). Tests: tests/test_async.py.
"""

from numba import cuda

from ..runtime.backend import SIMULATOR

BYTES = 16

if SIMULATOR:
    import threading

    import numpy as np

    from .vector import checked_row

    _queues = threading.local()  # the simulator runs one Python thread per CUDA thread

    def _groups():
        if not hasattr(_queues, "groups"):
            _queues.groups = [[]]  # closed groups, then the open one
        return _queues.groups

    def copy16(shared, shared_index, source, source_index):
        destination, i = checked_row(shared, shared_index, BYTES, "copy16")
        origin, k = checked_row(source, source_index, BYTES, "copy16")
        width = BYTES // origin.itemsize
        _groups()[-1].append((destination, i, origin[k:k + width].copy()))

    class _Address:
        """An array's bytes and an offset into them: what an address is in the simulator."""

        def __init__(self, buffer, offset):
            self.buffer, self.offset = buffer, int(offset)

        def __add__(self, offset):
            return _Address(self.buffer, self.offset + int(offset))

        __radd__ = __add__

        def __sub__(self, other):
            """Bytes from ``other`` (an address in the same array) to this one, or this address
            moved back by ``other`` bytes."""
            if isinstance(other, _Address):
                same = other.buffer is self.buffer or (  # (two views of one array's bytes)
                    other.buffer.ctypes.data == self.buffer.ctypes.data and len(other.buffer) == len(self.buffer))
                if not same:
                    raise ValueError("address difference across arrays")
                return self.offset - other.offset
            return _Address(self.buffer, self.offset - int(other))

        def span(self, size, what):
            """The ``size`` bytes from here (inside the array, and aligned to ``size``)."""
            if not 0 <= self.offset <= len(self.buffer) - size:
                raise IndexError(f"{what}: bytes {self.offset}..{self.offset + size} outside the array's "
                                 f"{len(self.buffer)}")
            if (self.buffer.ctypes.data + self.offset) % size:
                raise ValueError(f"{what}: address not aligned to {size} bytes")
            return slice(self.offset, self.offset + size)

        def bytes16(self, what):
            return self.span(BYTES, what)

    def global_address(array, index):
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            raise ValueError("global_address: the array is not contiguous")
        # The byte offset as the compiled code computes it: no bounds check until a copy uses it.
        offset = sum(int(i) * stride for i, stride in zip(index, array.strides))
        return _Address(array.reshape(-1).view(np.uint8), offset)

    shared_address = signed_address = global_address

    def copy16_to(shared, source):
        copy16_or_zero(shared, source, True)

    def _copy_or_zero(size):
        def copy_or_zero(shared, source, keep):
            span = source.span(size, f"copy{size} source")  # (in the array even where nothing is read)
            values = source.buffer[span].copy() if keep else np.zeros(size, np.uint8)
            _groups()[-1].append((shared.buffer, shared.span(size, f"copy{size} destination").start, values))

        return copy_or_zero

    copy16_or_zero, copy8_or_zero, copy4_or_zero = (_copy_or_zero(size) for size in (16, 8, 4))

    def commit():
        _groups().append([])

    def _land(keep):
        groups = _groups()
        closed, open_group = groups[:-1], groups[-1]
        for group in closed[:max(0, len(closed) - keep)]:
            for destination, i, values in group:
                destination[i:i + len(values)] = values
        _queues.groups = closed[max(0, len(closed) - keep):] + [open_group]

    def _wait(keep):
        def wait():
            _land(keep)

        return wait

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import element_pointer, indexes

    I32, I64 = ir.IntType(32), ir.IntType(64)

    def _address(context, builder, array_type, array, index_type, index):
        pointer = element_pointer(context, builder, array_type, array, index_type, index)
        return builder.ptrtoint(pointer, I64)

    def _to_shared(builder, generic):
        """The 32-bit shared-window address of a generic pointer to shared memory."""
        asm = ir.InlineAsm(ir.FunctionType(I32, [I64]),
                           "{ .reg .u64 s64; cvta.to.shared.u64 s64, $1; cvt.u32.u64 $0, s64; }", "=r,l")
        return builder.call(asm, [generic])

    def _issue(builder, to, origin, size=None, width=BYTES):
        """cp.async of ``width`` bytes (16: through L2 only, ``.cg``; 4 or 8: ``.ca``, the only
        form of those) from origin (64-bit global) to to (32-bit shared); with size (an i32), only
        that many bytes are read and the rest are zeros."""
        cache = "cg" if width == BYTES else "ca"
        if size is None:
            ptx = f"cp.async.{cache}.shared.global [$0], [$1], {width};"
            constraints, args = "r,l,~{memory}", [to, origin]
        else:
            ptx, constraints, args = (f"cp.async.{cache}.shared.global [$0], [$1], {width}, $2;", "r,l,r,~{memory}",
                                      [to, origin, size])
        function = ir.FunctionType(ir.VoidType(), [a.type for a in args])
        builder.call(ir.InlineAsm(function, ptx, constraints, side_effect=True), args)

    @intrinsic
    def copy16(typingctx, shared, shared_index, source, source_index):
        if not (indexes(shared, shared_index) and indexes(source, source_index)):
            return None
        signature = types.void(shared, shared_index, source, source_index)

        def codegen(context, builder, sig, args):
            to = _to_shared(builder, _address(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
            _issue(builder, to, _address(context, builder, sig.args[2], args[2], sig.args[3], args[3]))
            return context.get_dummy_value()

        return signature, codegen

    def _address_of(result):
        """An intrinsic giving the global address of ``array[index]`` as ``result`` (u/int64)."""

        @intrinsic
        def address(typingctx, array, index):
            if not indexes(array, index):
                return None

            def codegen(context, builder, sig, args):
                return _address(context, builder, sig.args[0], args[0], sig.args[1], args[1])

            return result(array, index), codegen

        return address

    global_address, signed_address = _address_of(types.uint64), _address_of(types.int64)

    @intrinsic
    def shared_address(typingctx, array, index):
        if not indexes(array, index):
            return None

        def codegen(context, builder, sig, args):
            return _to_shared(builder, _address(context, builder, sig.args[0], args[0], sig.args[1], args[1]))

        return types.uint32(array, index), codegen

    @intrinsic
    def copy16_to(typingctx, shared, source):
        if not (isinstance(shared, types.Integer) and isinstance(source, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            _issue(builder, context.cast(builder, args[0], sig.args[0], types.uint32),
                   context.cast(builder, args[1], sig.args[1], types.uint64))
            return context.get_dummy_value()

        return types.void(shared, source), codegen

    def _copy_or_zero(width):
        @intrinsic
        def copy_or_zero(typingctx, shared, source, keep):
            if not (isinstance(shared, types.Integer) and isinstance(source, types.Integer)
                    and isinstance(keep, (types.Integer, types.Boolean))):
                return None

            def codegen(context, builder, sig, args):
                kept = context.cast(builder, args[2], sig.args[2], types.boolean)
                size = builder.select(builder.icmp_unsigned("!=", kept, ir.Constant(kept.type, 0)),
                                      ir.Constant(I32, width), ir.Constant(I32, 0))
                _issue(builder, context.cast(builder, args[0], sig.args[0], types.uint32),
                       context.cast(builder, args[1], sig.args[1], types.uint64), size, width)
                return context.get_dummy_value()

            return types.void(shared, source, keep), codegen

        return copy_or_zero

    copy16_or_zero, copy8_or_zero, copy4_or_zero = (_copy_or_zero(width) for width in (16, 8, 4))

    def statement(ptx):
        """An intrinsic that emits ``ptx`` (no operands) as a side effect that orders memory."""

        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, sig, args):
                function = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(function, ptx, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        return emit

    def _wait(keep):
        return statement(f"cp.async.wait_group {keep};")

    commit = statement("cp.async.commit_group;")


MAX_IN_FLIGHT = 3
_waits = [_wait(keep) for keep in range(MAX_IN_FLIGHT + 1)]
wait_all, wait_but_one = _waits[0], _waits[1]


def waiter(keep):
    """The wait that blocks this thread until at most its newest ``keep`` groups are in flight."""
    if not 0 <= keep <= MAX_IN_FLIGHT:
        raise ValueError(f"keep: expected 0..{MAX_IN_FLIGHT} groups in flight, got {keep}")
    return _waits[keep]


def make_ring(issue, stages, stage_bytes, counter=True, visible=None, lag=1):
    """The stage ring every cp.async pipeline here runs, as two device functions over ``issue(s,
    at, args)`` (a kernel's: start stage s's copies into the buffer at shared address ``at``;
    ``args`` its tuple of whatever else that needs):

    * ``prime(base, count, args)``: stages 0 to ``stages - lag - 1`` in flight (those below
      ``count``), into buffers ``base``, ``base + stage_bytes``, ...; a commit group each, empty or
      not, so that the waits count stages;
    * ``advance(s, buf, base, count, args)``: wait until stage s (in buffer ``buf``, counting from
      0 at stage 0) has landed for this thread, then the barrier (for all threads; and every warp
      is done with the buffer of stage s - ``lag``), put stage s + ``stages - lag`` in flight into
      that buffer, and return (stage s's buffer's address, the next stage's ``buf``).

    ``lag``: 1, or 2 where a kernel still reads stage s - 1 while it starts on stage s (the
    wgmma forward's products of one tile overlap the next tile's scores).

    ``counter``: buffers found by that counter, else by ``s % stages`` (``buf`` passed through);
    which leaves a kernel fewer registers is ptxas's call (`tools/compile_check.py`: attention's
    kernels take the counter, the convolution's filter gradient the remainder). ``visible``: a
    device function each thread calls between its wait and the barrier (`wgmma.proxy_fence`,
    where the tensor cores read the stages through the async proxy)."""
    from ..runtime.compile import inlined

    if not 1 <= lag < stages:
        raise ValueError(f"lag: expected 1 to stages - 1 = {stages - 1}, got {lag}")
    ahead = stages - lag  # stages in flight after prime
    wait = waiter(ahead - 1)
    if visible is None:
        @inlined
        def visible():
            return None

    @inlined
    def prime(base, count, args):
        for s in range(ahead):
            if s < count:
                issue(s, base + s * stage_bytes, args)
            commit()

    @inlined
    def advance(s, buf, base, count, args):
        wait()
        visible()
        cuda.syncthreads()
        nxt = s + ahead  # (into the buffer lag stages before stage s's)
        if counter:
            if nxt < count:
                issue(nxt, base + (buf - lag if buf >= lag else buf + stages - lag) * stage_bytes, args)
            commit()
            return base + buf * stage_bytes, (buf + 1 if buf < stages - 1 else 0)
        if nxt < count:
            issue(nxt, base + (nxt % stages) * stage_bytes, args)
        commit()
        return base + (s % stages) * stage_bytes, buf

    return prime, advance
