"""Tensor-core multiply-add for Numba kernels: ``mma.sync`` m16n8k16, fp32 accumulators.

Numba exposes no tensor-core instruction; an intrinsic may emit inline PTX,
so ``mma_f16`` and ``mma_bf16`` issue ``mma.sync.aligned.m16n8k16.row.col``
with fp16 or bf16 inputs and fp32 accumulators. Every lane of a warp calls
it together (full mask) with its fragments, as the PTX ISA lays them out
(``groupID = lane >> 2``, ``t = lane % 4``):

* A (16 x 16, row-major), four 32-bit registers of two 16-bit values each
  (low half first): ``a0`` = A[g, 2t:2t+2], ``a1`` = A[g+8, 2t:2t+2],
  ``a2`` = A[g, 2t+8:2t+10], ``a3`` = A[g+8, 2t+8:2t+10];
* B (16 x 8, K x N), two registers: ``b0`` = B[2t:2t+2, g], ``b1`` = B[2t+8:2t+10, g];
* C and D (16 x 8, fp32): ``c0, c1`` = C[g, 2t], C[g, 2t+1]; ``c2, c3`` = C[g+8, 2t], C[g+8, 2t+1].

It returns this lane's ``(d0, d1, d2, d3)`` of D = A·B + C. Inputs travel as
16-bit patterns (fp16 views as int16, bf16 is int16 already): ``pack(lo, hi)``
makes a register of two. The fragment helpers (`a_fragment`, ...) give each
register's (row, column) so kernels and tests share one statement of the layout.

``mma_tf32`` is ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: the
same registers, each holding one tf32 value (an fp32 bit pattern whose low 13
bits are zero, made by ``to_tf32``) instead of two 16-bit ones, so the
fragments are the 16-bit ones in units of registers: A (16 x 8) ``a0`` =
A[g, t], ``a1`` = A[g+8, t], ``a2`` = A[g, t+4], ``a3`` = A[g+8, t+4]; B (8 x 8)
``b0`` = B[t, g], ``b1`` = B[t+4, g]; C and D as above. ``mma_3xtf32`` splits
fp32 operands into a tf32 head and a tf32 tail and adds the three products
that matter (tail·head, head·tail, head·head; tail·tail is below fp32's
precision), which keeps fp32 accuracy on tensor cores (NVIDIA's "3xTF32").
``make_3xtf32_parts`` gives the split and the product of an A split once, for kernels that
multiply one A fragment by many B fragments.

``mma_b1_and`` is ``mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc``: 1-bit A
(16 x 256) and B (256 x 8), D = popc(A & B) + C in int32, each register 32 bits of a row (A) or
column (B), bit i the value at k + i: ``a0`` = A[g, 32t:32t+32], ``a1`` = A[g+8, 32t:...],
``a2`` = A[g, 128+32t:...], ``a3`` = A[g+8, 128+32t:...]; ``b0`` = B[32t:32t+32, g],
``b1`` = B[128+32t:..., g]; C and D as above, in int32 (`b1_a_fragment`, `b1_b_fragment`).
A product only needs A's and B's k positions to agree, so kernels may fill the 256 k-slots
of a step from any words, as long as both operands take the same.

In the CUDA simulator ``mma_f16``/``mma_bf16`` are warp collectives built on
the simulator's rendezvous (`_simulator.py`): each lane hands in its
fragments, the full tiles are rebuilt from all 32, and each lane gets its
part of D (summed in float64, rounded to float32: the hardware's rounding of
the sum may differ in the last bit).
"""

from numba import cuda, float32, int32, uint32
from numba.cuda import libdevice

from ..runtime.backend import SIMULATOR

MMA_M, MMA_N, MMA_K = 16, 8, 16
TF32_K = 8
B1_K = 256  # bits of k an m16n8k256 b1 step
B1_WORDS = B1_K // 32
TF32_MASK = 0xFFFFE000  # the bits of an fp32 pattern that tf32 keeps (the tensor cores read)
TF32_HALF = 0x1000  # half of tf32's last place, in fp32 bits
TAIL_MAX = 0x7FFFFFFF - TF32_HALF  # the largest tail pattern whose rounding does not carry into the sign
FULL_MASK = 0xFFFFFFFF


@cuda.jit(device=True, inline=True)
def pack(lo, hi):
    """One 32-bit register holding two 16-bit patterns, ``lo`` in the low half."""
    return uint32((uint32(lo) & uint32(0xFFFF)) | ((uint32(hi) & uint32(0xFFFF)) << uint32(16)))


def a_fragment(lane, register):
    """(row, column) of the first of the two values in A register ``register`` (0-3) of ``lane``."""
    g, t = lane >> 2, lane % 4
    return g + 8 * (register % 2), 2 * t + 8 * (register // 2)


def b_fragment(lane, register):
    """(row, column) of the first of the two values in B register ``register`` (0-1) of ``lane``;
    the second is one row down."""
    g, t = lane >> 2, lane % 4
    return 2 * t + 8 * register, g


def c_fragment(lane, index):
    """(row, column) of C/D value ``index`` (0-3) of ``lane``."""
    g, t = lane >> 2, lane % 4
    return g + 8 * (index // 2), 2 * t + index % 2


def tf32_a_fragment(lane, register):
    """(row, column) of the tf32 value in A register ``register`` (0-3) of ``lane`` (16 x 8)."""
    row, col = a_fragment(lane, register)
    return row, col // 2


def tf32_b_fragment(lane, register):
    """(row, column) of the tf32 value in B register ``register`` (0-1) of ``lane`` (8 x 8)."""
    row, col = b_fragment(lane, register)
    return row // 2, col


def b1_a_fragment(lane, register):
    """(row, first k) of the 32 bits in b1 A register ``register`` (0-3) of ``lane`` (16 x 256)."""
    g, t = lane >> 2, lane % 4
    return g + 8 * (register % 2), 32 * t + 128 * (register // 2)


def b1_b_fragment(lane, register):
    """(first k, column) of the 32 bits in b1 B register ``register`` (0-1) of ``lane`` (256 x 8)."""
    g, t = lane >> 2, lane % 4
    return 32 * t + 128 * register, g


if SIMULATOR:
    import numpy as np

    from ..runtime import simulator as _simulator

    def _decode(bits, kind):
        bits = np.uint32(bits)
        halves = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16)
        if kind == "f16":
            return halves.view(np.float16).astype(np.float64)
        return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def _collective(name, k, fill):
        """A simulated mma of a K of `k`: each lane hands in its fragments, fill(A, B, lane, a, b)
        puts one lane's into the tiles, and each lane gets its part of D."""

        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            lane, fragments = _simulator._masked_collective(
                name, FULL_MASK, ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)))
            if len(fragments) != 32:
                raise _simulator.WarpCollectiveError(f"{name}: needs all 32 lanes of a warp")
            A, B, C = np.zeros((MMA_M, k)), np.zeros((k, MMA_N)), np.zeros((MMA_M, MMA_N))
            for peer, (a, b, c) in fragments.items():
                fill(A, B, peer, a, b)
                for i in range(4):
                    C[c_fragment(peer, i)] = np.float32(c[i])
            D = (A @ B + C).astype(np.float32)
            return tuple(D[c_fragment(lane, i)] for i in range(4))

        return mma

    def _pairs(kind):
        """fill for registers of two 16-bit values."""

        def fill(A, B, peer, a, b):
            for r in range(4):
                row, col = a_fragment(peer, r)
                A[row, col:col + 2] = _decode(a[r], kind)
            for r in range(2):
                row, col = b_fragment(peer, r)
                B[row:row + 2, col] = _decode(b[r], kind)

        return fill

    def _singles(value):
        """fill for registers of one 32-bit value each, read by value(bits)."""

        def fill(A, B, peer, a, b):
            for r in range(4):
                A[tf32_a_fragment(peer, r)] = value(a[r])
            for r in range(2):
                B[tf32_b_fragment(peer, r)] = value(b[r])

        return fill

    def _fp32_value(bits):
        return float(np.array([np.uint32(bits)], np.uint32).view(np.float32)[0])

    def _tf32_value(bits):
        """What the tensor cores read of a tf32 register: the fp32 value of its upper 19 bits."""
        return _fp32_value(np.uint32(bits) & np.uint32(TF32_MASK))

    mma_f16 = _collective("mma_f16", MMA_K, _pairs("f16"))
    mma_bf16 = _collective("mma_bf16", MMA_K, _pairs("bf16"))
    mma_tf32 = _collective("mma_tf32", TF32_K, _singles(_tf32_value))
    # One collective instead of three (the simulator's rendezvous is slow): fp32 products in
    # float64, which 3xTF32 matches to about 2^-22; the split itself is checked on the GPU.
    _mma_3xtf32_simulated = _collective("mma_3xtf32", TF32_K, _singles(_fp32_value))

    def _bits_of(word):
        return (np.uint32(word) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)

    def mma_b1_and(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """The b1 and.popc mma as a warp collective (see the module's docstring)."""
        lane, fragments = _simulator._masked_collective(
            "mma_b1_and", FULL_MASK, ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)))
        if len(fragments) != 32:
            raise _simulator.WarpCollectiveError("mma_b1_and: needs all 32 lanes of a warp")
        A, B = np.zeros((MMA_M, B1_K), np.int64), np.zeros((B1_K, MMA_N), np.int64)
        C = np.zeros((MMA_M, MMA_N), np.int64)
        for peer, (a, b, c) in fragments.items():
            for r in range(4):
                row, k = b1_a_fragment(peer, r)
                A[row, k:k + 32] = _bits_of(a[r])
            for r in range(2):
                k, col = b1_b_fragment(peer, r)
                B[k:k + 32, col] = _bits_of(b[r])
            for i in range(4):
                C[c_fragment(peer, i)] = int(c[i])
        D = ((A @ B + C + 2**31) % 2**32 - 2**31).astype(np.int32)  # (int32 wraps as on the GPU)
        return tuple(D[c_fragment(lane, i)] for i in range(4))

    def to_tf32(value):
        """cvt.rna.tf32.f32: round to 10 mantissa bits, ties away from zero (bits of the result)."""
        bits = int(np.array([value], np.float32).view(np.uint32)[0])
        if (bits >> 23) & 0xFF == 0xFF:  # inf and NaN keep their pattern
            return np.uint32(bits)
        return np.uint32(((bits + TF32_HALF) & TF32_MASK) & 0xFFFFFFFF)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _compiled(kind, shape="m16n8k16"):
        instruction = (f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 "
                       "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            signature = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, sig, args):
                i32, f32 = ir.IntType(32), ir.FloatType()
                function = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(function, instruction, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                result = builder.call(asm, list(args))
                items = [builder.extract_value(result, k) for k in range(4)]
                return context.make_tuple(builder, sig.return_type, items)

            return signature, codegen

        return mma

    mma_f16, mma_bf16 = _compiled("f16"), _compiled("bf16")
    mma_tf32 = _compiled("tf32", shape="m16n8k8")

    @intrinsic
    def mma_b1_and(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync m16n8k256 b1 and.popc, int32 accumulators (see the module's docstring)."""
        signature = types.UniTuple(types.int32, 4)(*([types.uint32] * 6 + [types.int32] * 4))

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            function = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 10)
            asm = ir.InlineAsm(function, "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc "
                               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                               "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
            result = builder.call(asm, list(args))
            items = [builder.extract_value(result, k) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, items)

        return signature, codegen

    @intrinsic
    def to_tf32(typingctx, value):
        """cvt.rna.tf32.f32: fp32 rounded to tf32 (nearest, ties away), as its bit pattern."""
        signature = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            function = ir.FunctionType(ir.IntType(32), [ir.FloatType()])
            asm = ir.InlineAsm(function, "cvt.rna.tf32.f32 $0, $1;", "=r,f")
            return builder.call(asm, list(args))

        return signature, codegen


if SIMULATOR:
    mma_3xtf32 = _mma_3xtf32_simulated

    def make_mma_3xtf32(nan_safe=True):
        return _mma_3xtf32_simulated  # (float64 products: a NaN stays one)

    def make_3xtf32_parts(nan_safe=True):
        """(split, mma_split) as on the GPU: the split by the same bit arithmetic, the product
        of the joined parts (head + the tail before its rounding: the value, for finite ones;
        NaN for an infinity, as the GPU's products) in float64."""
        tail_limit = np.int32(TAIL_MAX if nan_safe else 0x7FFFFFFF)

        def split(word):
            head = np.uint32((int(np.uint32(word)) + TF32_HALF) & TF32_MASK)
            with np.errstate(invalid="ignore", over="ignore"):
                tail = np.array([word], np.uint32).view(np.float32) - np.array([head], np.uint32).view(np.float32)
            bits = min(int(tail.view(np.int32)[0]), int(tail_limit)) + TF32_HALF
            return head, np.uint32(bits & 0xFFFFFFFF)

        def join(head, tail):
            exact = np.uint32((int(tail) - TF32_HALF) & 0xFFFFFFFF)  # (the tail before its rounding)
            with np.errstate(invalid="ignore", over="ignore"):
                value = np.array([head], np.uint32).view(np.float32) + np.array([exact], np.uint32).view(np.float32)
            return np.uint32(value.view(np.uint32)[0])

        def mma_split(a0h, a1h, a2h, a3h, a0t, a1t, a2t, a3t, b0, b1, c0, c1, c2, c3):
            return _mma_3xtf32_simulated(join(a0h, a0t), join(a1h, a1t), join(a2h, a2t), join(a3h, a3t),
                                         b0, b1, c0, c1, c2, c3)

        return split, mma_split
else:

    def make_mma_3xtf32(nan_safe=True):
        """mma_3xtf32 with fp32 operands split by their bits (`nan_safe`: a NaN operand gives a
        NaN, at one more instruction a split; else it may give a finite product)."""
        split, mma_split = make_3xtf32_parts(nan_safe)

        @cuda.jit(device=True, inline=True)
        def mma_3xtf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            """D = A·B + C for fp32 A (16 x 8) and B (8 x 8) given as bit patterns (uint32),
            to about fp32's accuracy, in three tf32 multiply-adds, smallest terms first."""
            a0h, a0t = split(a0)
            a1h, a1t = split(a1)
            a2h, a2t = split(a2)
            a3h, a3t = split(a3)
            return mma_split(a0h, a1h, a2h, a3h, a0t, a1t, a2t, a3t, b0, b1, c0, c1, c2, c3)

        return mma_3xtf32

    def make_3xtf32_parts(nan_safe=True):
        """(split, mma_split): ``split(word)``, an fp32 pattern's tf32 (head, tail), and
        ``mma_split(a0h..a3h, a0t..a3t, b0, b1, c0..c3)``, `mma_3xtf32` of an A already split,
        for kernels that multiply one A fragment by many B fragments."""
        tail_limit = TAIL_MAX if nan_safe else 0x7FFFFFFF  # (the latter: no clamp, folded away)

        @cuda.jit(device=True, inline=True)
        def split(word):
            """An fp32 value (as its bits) as tf32 head and tail, head + tail = the value to ~2^-22.

            Rounding by the bits: add half a tf32 ulp, clear the 13 low bits (the tensor cores
            ignore them, so the tail's are left). For finite values this is what to_tf32
            (cvt.rna.tf32.f32) gives, in two integer instructions (one for the tail) where ptxas
            makes the conversion three (it tests for inf and NaN first); an infinite input makes
            its products NaN instead of infinite. The GPU's NaN is 0x7FFFFFFF: half an ulp more
            carries it into the sign (the head of a NaN can come out -0), and the tail of a NaN
            or an infinity is that NaN, so the tail's rounding stops below the carry
            (`TAIL_MAX`) and the NaN reaches the products."""
            head = (uint32(word) + uint32(TF32_HALF)) & uint32(TF32_MASK)
            tail = float32(libdevice.int_as_float(int32(word)) - libdevice.int_as_float(int32(head)))
            return head, uint32(min(libdevice.float_as_int(tail), int32(tail_limit)) + int32(TF32_HALF))

        @cuda.jit(device=True, inline=True)
        def mma_split(a0h, a1h, a2h, a3h, a0t, a1t, a2t, a3t, b0, b1, c0, c1, c2, c3):
            b0h, b0t = split(b0)
            b1h, b1t = split(b1)
            d = mma_tf32(a0t, a1t, a2t, a3t, b0h, b1h, c0, c1, c2, c3)
            d = mma_tf32(a0h, a1h, a2h, a3h, b0t, b1t, d[0], d[1], d[2], d[3])
            return mma_tf32(a0h, a1h, a2h, a3h, b0h, b1h, d[0], d[1], d[2], d[3])

        return split, mma_split

    mma_3xtf32 = make_mma_3xtf32()
