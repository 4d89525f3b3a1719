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

In the CUDA simulator ``mma_f16``/``mma_bf16`` are warp collectives built on
the simulator's rendezvous (`_simulator.py`): each lane hands in its
fragments, the full tiles are rebuilt from all 32, and each lane gets its
part of D (summed in float64, rounded to float32: the hardware's rounding of
the sum may differ in the last bit).
"""

from numba import cuda, uint32

from .._backend import SIMULATOR

MMA_M, MMA_N, MMA_K = 16, 8, 16
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


if SIMULATOR:
    import numpy as np

    from . import _simulator

    def _decode(bits, kind):
        bits = np.uint32(bits)
        halves = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16)
        if kind == "f16":
            return halves.view(np.float16).astype(np.float64)
        return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def _simulated(kind):
        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            lane, fragments = _simulator._masked_collective(
                f"mma_{kind}", FULL_MASK, ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)))
            if len(fragments) != 32:
                raise _simulator.WarpCollectiveError(f"mma_{kind}: needs all 32 lanes of a warp")
            A = np.zeros((MMA_M, MMA_K))
            B = np.zeros((MMA_K, MMA_N))
            C = np.zeros((MMA_M, MMA_N))
            for peer, (a, b, c) in fragments.items():
                for r in range(4):
                    row, col = a_fragment(peer, r)
                    A[row, col:col + 2] = _decode(a[r], kind)
                for r in range(2):
                    row, col = b_fragment(peer, r)
                    B[row:row + 2, col] = _decode(b[r], kind)
                for i in range(4):
                    C[c_fragment(peer, i)] = np.float32(c[i])
            D = (A @ B + C).astype(np.float32)
            return tuple(D[c_fragment(lane, i)] for i in range(4))

        return mma

    mma_f16, mma_bf16 = _simulated("f16"), _simulated("bf16")

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _compiled(kind):
        instruction = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                       "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            signature = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, sig, args):
                i32, f32 = ir.IntType(32), ir.FloatType()
                function = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(function, instruction, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=True)
                result = builder.call(asm, list(args))
                items = [builder.extract_value(result, k) for k in range(4)]
                return context.make_tuple(builder, sig.return_type, items)

            return signature, codegen

        return mma

    mma_f16, mma_bf16 = _compiled("f16"), _compiled("bf16")
