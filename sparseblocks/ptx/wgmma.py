"""Hopper's warpgroup tensor-core multiply-add (``wgmma.mma_async``) and the fences around it.

A warpgroup is four consecutive warps (threads 128g .. 128g + 127). ``wgmma`` multiplies a 64 x 16
tile of A by a 16 x n tile of B, both read from shared memory through 64-bit *descriptors*, into
64 x n fp32 accumulators spread over the warpgroup's registers, and it runs asynchronously:

* ``fence()`` (``wgmma.fence``) before a batch: orders the accumulators' earlier writes;
* ``mma(acc, desc_a, desc_b, scale_d)`` (made by `make_mma`): acc = A·B + (acc if scale_d else 0),
  ``acc`` n / 2 values of a float32 local array (from ``first``, a maker's argument, so that a
  warpgroup can hold several tiles' accumulators in one array), updated in place once the group
  completes; made with ``overwrite=True``, acc = A·B whatever scale_d, and the old values are no
  operand (a batch's first product: the compiler then needs not carry them into the accumulator
  registers after the fence, which ptxas answers by serializing every wgmma, C7514);
* ``mma_rs(acc, a0, a1, a2, a3, desc_b, scale_d)`` (made by `make_mma_rs`): the same with A from
  registers, each warp's 16 rows of the 64 x 16 tile as four uint32 of two 16-bit values, laid out
  as mma.sync m16n8k16's A fragment (`a_position`): a score tile's accumulators, packed, are the
  A of the next product with no trip through shared memory;
* ``commit()`` closes this warpgroup's batch; ``waiter(k)`` returns the wait until at most k
  batches are in flight. The accumulators and the shared tiles of a batch in flight must not be
  touched until a wait covers it, and ``settle(acc)`` (`make_settle`) after the last wait keeps
  the compiler from moving reads of them above it;
* ``proxy_fence()`` (``fence.proxy.async.shared::cta``): shared stores and cp.async copies are
  the generic proxy's, wgmma reads through the async proxy; each writing thread fences after its
  copies have landed and before the barrier that hands the tile to the warpgroups.

Shared tiles lie in one of wgmma's canonical layouts. ``descriptor(address, lbo, sbo, swizzle)``
packs the start address, two byte strides and the swizzle mode (0 none, ``SWIZZLE_128``):

* interleaved (no swizzle): 8 x 8 core matrices of 16-bit values, 128 contiguous bytes each
  (eight 16-byte rows); ``lbo`` steps between core matrices adjacent in k, ``sbo`` in m or n;
* 128-byte swizzle: atoms of 8 rows of 128 bytes (1024 bytes, at a multiple of 1024), in which
  16-byte chunk c of row r lies at chunk ``c ^ r`` (`swizzled`). K-major (rows along k, 64 values
  a row): ``sbo`` steps between atoms of 8 rows, ``lbo`` is unused, and a k16 step starts 32 bytes
  further along the rows. MN-major (rows along m or n, 64 values, at one k each): ``sbo`` steps
  between atoms of 8 k, ``lbo`` between 64-wide groups of m or n; a k16 step is two atoms.
* 64- and 32-byte swizzles (``SWIZZLE_64``, ``SWIZZLE_32``): the same with rows of 64 (32) bytes,
  32 (16) values, atoms of 512 (256) bytes, chunk c of row r at ``c ^ (r // 2) % 4`` (``c ^ (r //
  4) % 2``): the address bits 7 and up XORed into the chunk's, as the 128-byte swizzle does. An
  operand of 32 (16) values of m or n a row, a 32-wide block say, needs no padding to 128 bytes.

In a K-major operand a stored row holds values of k of one m (or n); in an MN-major one values of
m (or n) at one k, and the instruction's transpose flag says which.

Accumulator layout (as mma.sync's C fragment, a warp per 16 rows): warp w of the group, lane l,
value ``4j + 2h + e`` is row ``16w + l // 4 + 8h``, column ``8j + 2(l % 4) + e``
(`acc_position`).

In the CUDA simulator the instruction is a warpgroup collective built on the simulator's
rendezvous (its four warps meet), which reads both tiles from shared memory through the
descriptors, in float64, rounded to float32 at the end; the waits land nothing (the product is
complete when the call returns). ``fence``, ``commit`` and the waits are ``.aligned``: every thread
of the warpgroup runs each one or none does, and a product checks that its threads have run as
many (a fence under a branch that only some warps take raises there).
"""

from numba import cuda, uint32, uint64

from ..runtime.backend import SIMULATOR

WGMMA_M, WGMMA_K = 64, 16
WARPGROUP = 128  # threads
CORE_BYTES = 128  # an 8 x 8 core matrix of 16-bit values
SWIZZLE_128, SWIZZLE_64, SWIZZLE_32 = 1, 2, 3  # the descriptor's modes for swizzled atoms
ROW_BYTES = {SWIZZLE_128: 128, SWIZZLE_64: 64, SWIZZLE_32: 32}  # an atom row of each mode
SHAPES_N = tuple(range(8, 257, 8))  # m64nNk16 for fp16 and bf16
MAX_IN_FLIGHT = 3


def swizzled(offset, mode=SWIZZLE_128):
    """The byte offset (from a multiple of 1024) where a swizzle ``mode`` puts logical ``offset``:
    address bits 7.. XORed into the 16-byte chunk's bits 4.. (3 of them for 128 bytes, 2 for 64, 1
    for 32)."""
    return offset ^ (((offset >> 7) & (ROW_BYTES[mode] // 16 - 1)) << 4)


def acc_position(thread, index):
    """(row, column) in the 64 x n tile of accumulator ``index`` of warpgroup thread ``thread``."""
    warp, lane = thread // 32, thread % 32
    j, h, e = index // 4, (index // 2) % 2, index % 2
    return 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e


def a_position(thread, index, half):
    """(row, k) in the 64 x 16 tile of A of half ``half`` (0: the low 16 bits) of register
    ``index`` (0-3) of warpgroup thread ``thread`` (`make_mma_rs`)."""
    warp, lane = thread // 32, thread % 32
    return 16 * warp + lane // 4 + 8 * (index % 2), 2 * (lane % 4) + 8 * (index // 2) + half


def _check_shape(n, kind):
    if n not in SHAPES_N:
        raise ValueError(f"n: expected a multiple of 8 from 8 to 256, got {n}")
    if kind not in ("f16", "bf16"):
        raise ValueError(f"kind: expected 'f16' or 'bf16', got {kind!r}")


if SIMULATOR:
    import numpy as np

    from ..runtime import simulator as _simulator
    from .cp_async import _Address

    class _Descriptor:
        """A descriptor in the simulator: the shared address, lbo and sbo (``+ k`` moves the start
        by k 16-byte units, as adding to the compiled descriptor does)."""

        def __init__(self, address, lbo, sbo, swizzle):
            self.address, self.lbo, self.sbo, self.swizzle = address, int(lbo), int(sbo), int(swizzle)

        def __add__(self, units):
            return _Descriptor(self.address + 16 * int(units), self.lbo, self.sbo, self.swizzle)

        __radd__ = __add__

    def descriptor(address, lbo, sbo, swizzle):
        if not isinstance(address, _Address):
            raise TypeError("descriptor: expected a shared address (cp_async.shared_address)")
        if int(swizzle) not in (0, SWIZZLE_128, SWIZZLE_64, SWIZZLE_32):
            raise ValueError(f"descriptor: swizzle mode {swizzle} is not modelled")
        return _Descriptor(address, lbo, sbo, swizzle)

    def align_up(address, alignment):
        """The first address at or after ``address`` that is a multiple of ``alignment`` (the
        simulator counts from the start of the shared array)."""
        return _Address(address.buffer, -(-address.offset // alignment) * alignment)

    def _tile(desc, rows, mn_major, kind):
        """The (rows x 16) tile, m or n by k, that a descriptor points at, as float64."""
        buffer, start = desc.address.buffer, desc.address.offset
        r, k = np.arange(rows)[:, None], np.arange(WGMMA_K)[None, :]
        if not desc.swizzle:
            at = start + (r // 8) * desc.sbo + (k // 8) * desc.lbo
            at = at + ((k % 8) * 16 + 2 * (r % 8) if mn_major else (r % 8) * 16 + 2 * (k % 8))
        elif mn_major:  # atoms: 8 k of W / 2 m/n; sbo between atoms along k, lbo between W/2-groups
            W, mode = ROW_BYTES[desc.swizzle], desc.swizzle
            at = swizzled(start + (k // 8) * desc.sbo + (r // (W // 2)) * desc.lbo + (k % 8) * W + 2 * (r % (W // 2)),
                          mode)
        else:  # atoms: 8 rows of W / 2 k; sbo between atoms; the start moves along the rows
            W, mode = ROW_BYTES[desc.swizzle], desc.swizzle
            if (start % W) + 2 * WGMMA_K > W:
                raise ValueError(f"wgmma: a K-major k16 step from byte {start % W} leaves its {W}-byte swizzle row")
            at = swizzled(start + (r // 8) * desc.sbo + (r % 8) * W + 2 * k, mode)
        if at.min() < 0 or at.max() > len(buffer) - 2:
            raise IndexError(f"wgmma: bytes {at.min()}..{at.max() + 2} outside the shared array's {len(buffer)}")
        if (buffer.ctypes.data + start) % 16:
            raise ValueError("wgmma: a descriptor's start address must be a multiple of 16 bytes")
        bits = buffer[at].astype(np.uint16) | (buffer[at + 1].astype(np.uint16) << 8)
        if kind == "f16":
            return bits.view(np.float16).astype(np.float64)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def make_mma(n, kind, a_mn_major, b_mn_major, first=0, overwrite=False):
        _check_shape(n, kind)
        regs = n // 2

        def mma(acc, desc_a, desc_b, scale_d):
            scale_d = 0 if overwrite else scale_d
            me, values = _simulator._group_collective(
                "wgmma", WARPGROUP, (desc_a, desc_b, int(scale_d), np.array(acc[first:first + regs], np.float32),
                                     _aligned_count()))
            with _simulator.block_lock():  # (the first thread out computes it for the group, once,
                _product(values, n, kind, a_mn_major, b_mn_major, regs)  # before any member moves on)
            D = values["D"]
            for i in range(regs):
                acc[first + i] = D[acc_position(me, i)]

        return mma

    def _halves(word, kind):
        """The two 16-bit values of a register (low half first), as float64."""
        bits = np.array([int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF], np.uint16)
        if kind == "f16":
            return bits.view(np.float16).astype(np.float64)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def make_mma_rs(n, kind, b_mn_major, first=0):
        _check_shape(n, kind)
        regs = n // 2

        def mma_rs(acc, a0, a1, a2, a3, desc_b, scale_d):
            held = np.array(acc[first:first + regs], np.float32)
            a = (a0, a1, a2, a3)
            me, values = _simulator._group_collective("wgmma", WARPGROUP, (a, desc_b, int(scale_d), held,
                                                                          _aligned_count()))
            with _simulator.block_lock():
                _product(values, n, kind, None, b_mn_major, regs)
            D = values["D"]
            for i in range(regs):
                acc[first + i] = D[acc_position(me, i)]

        return mma_rs

    def _a_of_registers(held, kind):
        if len(held) != WARPGROUP:
            raise _simulator.WarpCollectiveError("wgmma: A from registers needs the whole warpgroup")
        A = np.zeros((WGMMA_M, WGMMA_K))
        for thread, value in held.items():
            for index, word in enumerate(value[0]):
                for half, x in enumerate(_halves(word, kind)):
                    A[a_position(thread, index, half)] = x
        return A

    def _product(values, n, kind, a_mn_major, b_mn_major, regs):
        """values["D"] = A·B (+ C), from the members' values, unless a member has computed it."""
        if "D" in values:
            return
        held = {i: v for i, v in list(values.items()) if i != "D"}
        desc_a0, desc_b0, scale0, _, aligned0 = held[0]
        if any(v[2] != scale0 for v in held.values()):
            raise _simulator.WarpCollectiveError("wgmma: scale_d differs across the warpgroup")
        if any(v[4] != aligned0 for v in held.values()):
            counts = sorted({v[4] for v in held.values()})
            raise _simulator.WarpCollectiveError(
                f"wgmma: the warpgroup's threads reach it after different numbers of wgmma.fence, commit "
                f"and wait ({counts}): those are .aligned, each one for every thread of the warpgroup or none "
                "(one under a branch some warps skip is undefined on a GPU, and can hang it)")
        A = _a_of_registers(held, kind) if a_mn_major is None else _tile(desc_a0, WGMMA_M, a_mn_major, kind)
        B = _tile(desc_b0, n, b_mn_major, kind).T
        C = np.zeros((WGMMA_M, n))
        if scale0:
            for thread, value in held.items():
                for i in range(regs):
                    C[acc_position(thread, i)] = value[3][i]
        values["D"] = (A @ B + C).astype(np.float32)

    def _nothing():
        return None

    def _aligned_count():
        """How many .aligned warpgroup instructions (fence, commit, wait) this thread has run."""
        return getattr(_simulator._me(), "_sb_wgmma_aligned", 0)

    def _aligned():
        me = _simulator._me()
        me._sb_wgmma_aligned = getattr(me, "_sb_wgmma_aligned", 0) + 1

    fence = commit = _aligned
    proxy_fence = _nothing

    def make_settle(n):
        def settle(acc):
            return None

        return settle

    def waiter(keep):
        if not 0 <= keep <= MAX_IN_FLIGHT:
            raise ValueError(f"keep: expected 0..{MAX_IN_FLIGHT} batches in flight, got {keep}")
        return _aligned

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .cp_async import statement

    @cuda.jit(device=True, inline=True)
    def descriptor(address, lbo, sbo, swizzle):
        """The 64-bit shared-memory matrix descriptor (base offset 0)."""
        return (uint64((uint32(address) & uint32(0x3FFFF)) >> uint32(4))
                | (uint64(uint32(lbo) >> uint32(4)) << uint64(16))
                | (uint64(uint32(sbo) >> uint32(4)) << uint64(32))
                | (uint64(swizzle) << uint64(62)))

    @cuda.jit(device=True, inline=True)
    def align_up(address, alignment):
        """The first shared address at or after ``address`` that is a multiple of ``alignment``."""
        return (uint32(address) + uint32(alignment - 1)) & ~uint32(alignment - 1)

    def make_mma(n, kind, a_mn_major, b_mn_major, first=0, overwrite=False):
        """acc[first:first + n / 2] (float32, in place) = A (64 x 16) · B (16 x n) + (that if scale_d
        else 0); with ``overwrite``, = A · B, the old values no operand."""
        _check_shape(n, kind)
        regs = n // 2
        outs = ", ".join(f"${i}" for i in range(regs))
        ptx = ("{ .reg .pred p; setp.ne.b32 p, $" + str(regs + 2) + ", 0; "
               f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{outs}}}, ${regs}, ${regs + 1}, "
               f"p, 1, 1, {int(a_mn_major)}, {int(b_mn_major)}; }}")
        constraints = ",".join(["=f"] * regs + ["l", "l", "r"] + ([] if overwrite else [str(i) for i in range(regs)]))

        @intrinsic
        def mma(typingctx, acc, desc_a, desc_b, scale_d):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
                return None
            signature = types.void(acc, types.uint64, types.uint64, types.int32)

            def codegen(context, builder, sig, args):
                f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
                data = context.make_array(sig.args[0])(context, builder, args[0]).data
                slots = [builder.gep(data, [ir.Constant(i32, first + i)]) for i in range(regs)]
                held = [] if overwrite else [builder.load(s) for s in slots]
                function = ir.FunctionType(ir.LiteralStructType([f32] * regs), [i64, i64, i32] + [f32] * len(held))
                asm = ir.InlineAsm(function, ptx, constraints, side_effect=True)
                scale = ir.Constant(i32, 0) if overwrite else args[3]
                result = builder.call(asm, [args[1], args[2], scale] + held)
                for i, slot in enumerate(slots):
                    builder.store(builder.extract_value(result, i), slot)
                return context.get_dummy_value()

            return signature, codegen

        return mma

    def make_mma_rs(n, kind, b_mn_major, first=0):
        """acc[first:first + n / 2] (float32, in place) = A (64 x 16, from the warpgroup's
        registers a0-a3, `a_position`) · B (16 x n, from ``desc_b``) + (that if scale_d else 0)."""
        _check_shape(n, kind)
        regs = n // 2
        outs = ", ".join(f"${i}" for i in range(regs))
        a = ", ".join(f"${regs + i}" for i in range(4))
        ptx = ("{ .reg .pred p; setp.ne.b32 p, $" + str(regs + 5) + ", 0; "
               f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{outs}}}, {{{a}}}, ${regs + 4}, "
               f"p, 1, 1, {int(b_mn_major)}; }}")
        constraints = ",".join(["=f"] * regs + ["r", "r", "r", "r", "l", "r"] + [str(i) for i in range(regs)])

        @intrinsic
        def mma_rs(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
                return None
            signature = types.void(acc, types.uint32, types.uint32, types.uint32, types.uint32, types.uint64,
                                   types.int32)

            def codegen(context, builder, sig, args):
                f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
                data = context.make_array(sig.args[0])(context, builder, args[0]).data
                slots = [builder.gep(data, [ir.Constant(i32, first + i)]) for i in range(regs)]
                held = [builder.load(s) for s in slots]
                function = ir.FunctionType(ir.LiteralStructType([f32] * regs), [i32] * 4 + [i64, i32] + [f32] * regs)
                asm = ir.InlineAsm(function, ptx, constraints, side_effect=True)
                result = builder.call(asm, list(args[1:7]) + held)
                for i, slot in enumerate(slots):
                    builder.store(builder.extract_value(result, i), slot)
                return context.get_dummy_value()

            return signature, codegen

        return mma_rs

    def make_settle(n):
        """settle(acc): pins the n / 2 accumulators after a wait, so that code reading them cannot
        move above it (the compiler sees the wait as touching memory only, and would hoist reads
        of the registers above it, which makes ptxas serialize every wgmma of the kernel)."""
        regs = n // 2
        constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)])

        @intrinsic
        def settle(typingctx, acc):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
                return None

            def codegen(context, builder, sig, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                data = context.make_array(sig.args[0])(context, builder, args[0]).data
                slots = [builder.gep(data, [ir.Constant(i32, i)]) for i in range(regs)]
                held = [builder.load(s) for s in slots]
                function = ir.FunctionType(ir.LiteralStructType([f32] * regs), [f32] * regs)
                result = builder.call(ir.InlineAsm(function, "", constraints, side_effect=True), held)
                for i, slot in enumerate(slots):
                    builder.store(builder.extract_value(result, i), slot)
                return context.get_dummy_value()

            return types.void(acc), codegen

        return settle

    fence = statement("wgmma.fence.sync.aligned;")
    commit = statement("wgmma.commit_group.sync.aligned;")
    proxy_fence = statement("fence.proxy.async.shared::cta;")
    _waits = [statement(f"wgmma.wait_group.sync.aligned {keep};") for keep in range(MAX_IN_FLIGHT + 1)]

    def waiter(keep):
        """The wait until at most this warpgroup's newest ``keep`` batches are in flight."""
        if not 0 <= keep <= MAX_IN_FLIGHT:
            raise ValueError(f"keep: expected 0..{MAX_IN_FLIGHT} batches in flight, got {keep}")
        return _waits[keep]
