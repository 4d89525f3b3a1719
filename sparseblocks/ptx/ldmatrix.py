"""Fragments from shared memory by ``ldmatrix``: ``ldmatrix_x4(shared, (i, ..., j))``,
``ldmatrix_x4_at(address)`` and ``ldmatrix_x4_trans_at(address)``; and one lane's 16 bytes,
``load4_shared_at(address)``.

``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` reads four 8 x 8 matrices of 16-bit values (a matrix
row: 16 bytes, four 32-bit words) from shared memory in one instruction. Every lane of the warp
calls it together and hands in the address of one row: lanes 8q to 8q + 7 the rows 0-7 of
matrix q. Each lane gets four words back, word ``lane % 4`` of row ``lane // 4`` of each matrix:
exactly the register layout the mma fragments use (for b1 A: ``a0`` of rows 0-7 and ``a1`` of
rows 8-15 at one k, ``a2`` and ``a3`` at k + 128 bits), so a warp's fragment of a row-major tile
is one instruction and no register moves. A row must be 16 contiguous bytes at a multiple of 16;
the eight rows of a matrix fall in distinct banks where a tile row is an odd number of 16 bytes
long (mod 128), which kernels arrange by padding.

With ``.trans`` each matrix arrives transposed: lane ``l`` gets values ``2(l % 4)`` and
``2(l % 4) + 1`` of column ``l // 4``, that is rows ``2(l % 4)`` and ``2(l % 4) + 1`` of the
matrix as stored, at position ``l // 4`` along them, packed low then high. A tile stored with the
mma's k axis down its rows (a k-by-m A, a k-by-n B) gives the m16n8k16 fragments this way.

``ldmatrix_x4(shared, index)``: ``shared`` a uint32 shared array, ``index`` this lane's row
start (its last index a multiple of 4 words). ``ldmatrix_x4_at(address)`` and
``ldmatrix_x4_trans_at(address)`` take the row's 32-bit shared-window address instead
(`cp_async.shared_address` plus byte offsets): kernels that walk a tile take the address once
and add constants, which the compiler folds into the instruction. All return 4 words, uint32.

``load4_shared_at(address)`` (``ld.shared.v4.u32``) is no collective: the 4 words at a 32-bit
shared-window address, a multiple of 16, read by this lane alone (a loop that walks a swizzled
tile from one address and constant steps, with no index arithmetic).

In the CUDA simulator the ldmatrix calls are warp collectives: each lane reads its row (the alignment checked
as a vector load's) and hands it in; each lane gets its words from its peers' rows.
"""

from ..runtime.backend import SIMULATOR

FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    import numpy as np

    from ..runtime import simulator as _simulator
    from .vector import checked_row

    def _exchange(name, row_words, transposed):
        """The collective: row_words, this lane's row as 4 uint32 words; returns its 4 words."""
        lane, rows = _simulator._masked_collective(name, FULL_MASK, tuple(row_words))
        if len(rows) != 32:
            raise _simulator.WarpCollectiveError(f"{name}: needs all 32 lanes of a warp")
        if not transposed:
            return tuple(np.uint32(rows[8 * q + lane // 4][lane % 4]) for q in range(4))
        got = []
        for q in range(4):
            matrix = np.array([rows[8 * q + r] for r in range(8)], np.uint32).view(np.uint16)  # 8 x 8
            lo, hi = matrix[2 * (lane % 4), lane // 4], matrix[2 * (lane % 4) + 1, lane // 4]
            got.append(np.uint32(int(lo) | int(hi) << 16))
        return tuple(got)

    def ldmatrix_x4(shared, index):
        row, j = checked_row(shared, index, 16, "ldmatrix_x4")
        return _exchange("ldmatrix_x4", np.asarray(row[j:j + 4]).view(np.uint32), False)

    def _row_at(address, what):
        return address.buffer[address.bytes16(what)].view(np.uint32)

    def ldmatrix_x4_at(address):
        return _exchange("ldmatrix_x4", _row_at(address, "ldmatrix_x4_at"), False)

    def ldmatrix_x4_trans_at(address):
        return _exchange("ldmatrix_x4_trans", _row_at(address, "ldmatrix_x4_trans_at"), True)

    def load4_shared_at(address):
        return tuple(np.uint32(w) for w in _row_at(address, "load4_shared_at"))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .cp_async import _address, _to_shared
    from .vector import indexes

    I32 = ir.IntType(32)

    LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
    LDMATRIX_TRANS = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"

    def _issue(builder, address, instruction):
        """``instruction`` (4 words from a 32-bit shared address), its words as 4 i32 values."""
        function = ir.FunctionType(ir.LiteralStructType([I32] * 4), [I32])
        asm = ir.InlineAsm(function, f"{instruction} {{$0,$1,$2,$3}}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                           side_effect=True)  # (ordered after the barrier waits that made the bytes visible)
        result = builder.call(asm, [address])
        return [builder.extract_value(result, k) for k in range(4)]

    @intrinsic
    def ldmatrix_x4(typingctx, shared, index):
        if not (indexes(shared, index) and shared.dtype.bitwidth == 32):
            return None
        signature = types.UniTuple(types.uint32, 4)(shared, index)

        def codegen(context, builder, sig, args):
            address = _to_shared(builder, _address(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
            return context.make_tuple(builder, sig.return_type, _issue(builder, address, LDMATRIX))

        return signature, codegen

    def _at(instruction):
        @intrinsic
        def load_at(typingctx, address):
            if not isinstance(address, types.Integer):
                return None
            signature = types.UniTuple(types.uint32, 4)(address)

            def codegen(context, builder, sig, args):
                address = context.cast(builder, args[0], sig.args[0], types.uint32)
                return context.make_tuple(builder, sig.return_type, _issue(builder, address, instruction))

            return signature, codegen

        return load_at

    ldmatrix_x4_at, ldmatrix_x4_trans_at = _at(LDMATRIX), _at(LDMATRIX_TRANS)
    load4_shared_at = _at("ld.shared.v4.u32")
