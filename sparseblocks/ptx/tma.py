"""Hopper's bulk tensor copies (TMA): a box of a 2-D tensor into shared memory, completing on an
mbarrier.

A tensor map (128 bytes in global memory, made on the host by `runtime.tensormap`) describes a
2-D tensor of 16-bit values: its dims (inner, outer), the bytes from one outer row to the next,
a box (inner, outer) and the 128-byte swizzle. Then:

* ``load_2d(shared, tensor_map, source, inner, outer, bar)``
  (``cp.async.bulk.tensor.2d...mbarrier::complete_tx::bytes``) copies the box whose first
  element is at (inner, outer) to the shared address ``shared`` (a multiple of 1024): box row r
  at ``shared + r * 128``, its 16-byte chunk c at chunk ``c ^ (r % 8)`` (the swizzle `ptx.wgmma`'s
  descriptors read). Elements past the tensor's dims are zeros; the copy's bytes, the whole
  box's, complete on ``bar``. One thread issues it; no register holds the data.
  ``tensor_map`` is the map's generic global address (`cp_async.global_address`), ``source``
  the tensor's own address (`cp_async.signed_address`), which only the simulator reads.
* ``expect_tx(bar, nbytes)`` (``mbarrier.arrive.expect_tx``): one arrival that also makes the
  barrier's phase wait for ``nbytes`` more of copies. A stage's producer calls it, then issues
  the stage's copies: the phase completes once every arrival is in and every byte has landed.

The copies write through the async proxy, as ``wgmma`` reads: a consumer that waits on the
barrier needs no proxy fence before its wgmmas.

In the CUDA simulator a tensor map holds the same description in fields of its own
(`runtime.tensormap`), and ``load_2d`` copies the box at once, swizzled and zero-filled as the
hardware does, then completes its bytes on the barrier (`runtime.simulator` counts them);
addresses outside either array, a misaligned destination or a box that does not fit the map
raise.
"""

from ..runtime.backend import SIMULATOR

SWIZZLE_BYTES = 128  # a box row with the 128-byte swizzle
ALIGN = 1024  # a swizzled box's shared destination


if SIMULATOR:
    import numpy as np

    from ..runtime import simulator as _simulator
    from ..runtime.tensormap import simulated_fields
    from .cp_async import _Address
    from .mbarrier import _byte

    def expect_tx(bar, nbytes):
        _simulator.mbarrier_expect_tx(_byte(bar, "mbarrier.arrive.expect_tx"), int(nbytes))

    def load_2d(shared, tensor_map, source, inner, outer, bar):
        for what, address in (("destination", shared), ("tensor map", tensor_map), ("source", source)):
            if not isinstance(address, _Address):
                raise TypeError(f"cp.async.bulk.tensor: expected the {what} as an address (cp_async)")
        at = _byte(bar, "cp.async.bulk.tensor")
        item, dims, row_bytes, box = simulated_fields(tensor_map.buffer[tensor_map.offset:tensor_map.offset + 128])
        if shared.offset % ALIGN:  # (the simulator counts from the shared array's start, as `wgmma.align_up`)
            raise ValueError(f"cp.async.bulk.tensor: shared destination not aligned to {ALIGN} bytes")
        if box[0] * item != SWIZZLE_BYTES:
            raise ValueError(f"cp.async.bulk.tensor: box rows of {box[0] * item} bytes, expected {SWIZZLE_BYTES}")
        nbytes = box[0] * box[1] * item
        if not 0 <= shared.offset <= len(shared.buffer) - nbytes:
            raise IndexError(f"cp.async.bulk.tensor: shared bytes {shared.offset}..{shared.offset + nbytes} outside "
                             f"the shared array's {len(shared.buffer)}")
        tile = np.zeros((box[1], SWIZZLE_BYTES), np.uint8)
        inner, outer = int(inner), int(outer)
        for r in range(box[1]):
            row = outer + r
            if not 0 <= row < dims[1]:
                continue
            for e in range(box[0]):
                col = inner + e
                if 0 <= col < dims[0]:
                    start = source.offset + row * row_bytes + col * item
                    if not 0 <= start <= len(source.buffer) - item:
                        raise IndexError(f"cp.async.bulk.tensor: element ({col}, {row}) outside the source array")
                    tile[r, e * item:(e + 1) * item] = source.buffer[start:start + item]
        out = np.empty_like(tile)
        for r in range(box[1]):  # the 128-byte swizzle: chunk c of row r lands at chunk c ^ (r % 8)
            for c in range(SWIZZLE_BYTES // 16):
                to = (c ^ (r % 8)) * 16
                out[r, to:to + 16] = tile[r, c * 16:c * 16 + 16]
        shared.buffer[shared.offset:shared.offset + nbytes] = out.reshape(-1)
        _simulator.mbarrier_complete_tx(at, nbytes)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    I32, I64 = ir.IntType(32), ir.IntType(64)

    def _integers(*args):
        return all(isinstance(a, (types.Integer, types.Boolean)) for a in args)

    @intrinsic
    def expect_tx(typingctx, bar, nbytes):
        if not _integers(bar, nbytes):
            return None

        def codegen(context, builder, sig, args):
            values = [context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args)]
            ptx = "{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], $1; }"
            function = ir.FunctionType(ir.VoidType(), [I32, I32])
            builder.call(ir.InlineAsm(function, ptx, "r,r,~{memory}", side_effect=True), values)
            return context.get_dummy_value()

        return types.void(bar, nbytes), codegen

    @intrinsic
    def load_2d(typingctx, shared, tensor_map, source, inner, outer, bar):
        if not _integers(shared, tensor_map, source, inner, outer, bar):
            return None

        def codegen(context, builder, sig, args):
            to = context.cast(builder, args[0], sig.args[0], types.uint32)
            tmap = context.cast(builder, args[1], sig.args[1], types.uint64)
            c0 = context.cast(builder, args[3], sig.args[3], types.int32)
            c1 = context.cast(builder, args[4], sig.args[4], types.int32)
            at = context.cast(builder, args[5], sig.args[5], types.uint32)
            ptx = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[$0], [$1, {$2, $3}], [$4];")
            function = ir.FunctionType(ir.VoidType(), [I32, I64, I32, I32, I32])
            builder.call(ir.InlineAsm(function, ptx, "r,l,r,r,r,~{memory}", side_effect=True), [to, tmap, c0, c1, at])
            return context.get_dummy_value()

        return types.void(shared, tensor_map, source, inner, outer, bar), codegen
