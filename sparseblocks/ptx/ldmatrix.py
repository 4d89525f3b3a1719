"""Fragments from shared memory by ``ldmatrix``: ``ldmatrix_x4(shared, (i, ..., j))``.

``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` reads four 8 x 8 matrices of 16-bit values (a matrix
row: 16 bytes, four 32-bit words) from shared memory in one instruction. Every lane of the warp
calls it together and hands in the address of one row: lanes 8q to 8q + 7 the rows 0-7 of
matrix q. Each lane gets four words back, word ``lane % 4`` of row ``lane // 4`` of each matrix:
exactly the register layout the mma fragments use (for b1 A: ``a0`` of rows 0-7 and ``a1`` of
rows 8-15 at one k, ``a2`` and ``a3`` at k + 128 bits), so a warp's fragment of a row-major tile
is one instruction and no register moves. A row must be 16 contiguous bytes at a multiple of 16;
the eight rows of a matrix fall in distinct banks where a tile row is an odd number of 16 bytes
long (mod 128), which kernels arrange by padding.

``ldmatrix_x4(shared, index)``: ``shared`` a uint32 shared array, ``index`` this lane's row
start (its last index a multiple of 4 words); returns the lane's 4 words as uint32.

In the CUDA simulator it is a warp collective: each lane reads its row (the alignment checked
as a vector load's) and hands it in; each lane gets its words from its peers' rows.
"""

from ..runtime.backend import SIMULATOR

FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    import numpy as np

    from ..runtime import simulator as _simulator
    from .vector import checked_row

    def ldmatrix_x4(shared, index):
        row, j = checked_row(shared, index, 16, "ldmatrix_x4")
        words = tuple(np.uint32(w) for w in np.asarray(row[j:j + 4]).view(np.uint32))
        lane, rows = _simulator._masked_collective("ldmatrix_x4", FULL_MASK, words)
        if len(rows) != 32:
            raise _simulator.WarpCollectiveError("ldmatrix_x4: needs all 32 lanes of a warp")
        return tuple(rows[8 * q + lane // 4][lane % 4] for q in range(4))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .cp_async import _address, _to_shared
    from .vector import indexes

    @intrinsic
    def ldmatrix_x4(typingctx, shared, index):
        if not (indexes(shared, index) and shared.dtype.bitwidth == 32):
            return None
        signature = types.UniTuple(types.uint32, 4)(shared, index)

        def codegen(context, builder, sig, args):
            address = _to_shared(builder, _address(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
            i32 = ir.IntType(32)
            function = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
            asm = ir.InlineAsm(function, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0,$1,$2,$3}, [$4];",
                               "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            result = builder.call(asm, [address])
            items = [builder.extract_value(result, k) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, items)

        return signature, codegen
