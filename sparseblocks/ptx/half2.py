"""fp16 operations Numba does not offer: ``add_half2(a, b)``, ``greater_mask_half2(a, b)``,
``half2_down(value)``, ``floats_of_half2(word)``, ``atomic_add_half(array, index, value)`` and
``atomic_add_half2(words, index, word)``.

``add_half2``: ``a`` and ``b`` are 32-bit words, each the bits of two neighbouring fp16
values (an fp16 array viewed as int32); the result is the word of their two
sums, each rounded to nearest (``add.rn.f16x2``). Numba has no bit cast
between int32 and a pair of halves, so the compiled function is an
intrinsic that emits the PTX instruction on the words themselves. It lets a
channels-last fp16 add move 4 bytes a thread-step instead of 2
(`sbnet.sparse_scatter` with ``add``).

``floats_of_half2(word)``: the two fp16 values whose bits ``word`` holds (low half
first), each widened to float32 (exact). It lets a kernel keep loaded fp16 values as
the words they came in (`_vector.load4_words`) and widen them only where it uses
them: kept as halves, ptxas packs them into registers next to the load, which then
waits for the load (`sbnet`'s transposing row copies).

``half2_of_floats(lo, hi)``: the word of two float32 values rounded to fp16 (``lo`` in the
low half; ``cvt.rn.f16x2.f32``), for a kernel that writes fp16 results as words or 16-byte
vectors of them (`gather_matmul`'s output tile).

``greater_mask_half2(a, b)``: the word whose halves are 0xFFFF where a's half is greater than
b's, else 0 (``set.gt.u32.f16x2``; a NaN compares false): two fp16 comparisons an instruction,
as masks for selects and bits. ``half2_down(value)``:
float32 ``value`` rounded toward minus infinity to fp16 (``cvt.rm.f16.f32``), in both halves of a
word: for an fp16 x, ``x > value`` exactly when ``x > half2_down(value)``'s half, since no fp16
lies between the rounded value and ``value`` (past fp16's range: 65504 above, minus infinity below).

``bf16_of_float(value)``: the bits (int16) of float32 ``value`` rounded to bf16, to nearest even
(``cvt.rn.bf16.f32``, sm_80 and later): one instruction where the integer rounding takes about
ten, for epilogues that store many bf16 values (version 7's). Overflow rounds to infinity; a NaN
becomes a NaN (the simulator gives the canonical 0x7FFF).

The atomics: Numba's ``cuda.atomic.add`` takes float32 and float64 arrays only,
but an fp16 scatter-add of overlapping windows (the gradient of a gather whose
windows share a halo, as every SBNet block's do) needs one. ``atomic_add_half``
adds an fp16 value to ``array[index]`` of a float16 array
(``red.global.add.noftz.f16``, sm_70 and later); ``atomic_add_half2`` adds the two
halves of ``word`` to the two of ``words[index]``, an fp16 array viewed as int32
(``red.global.add.noftz.f16x2``), each rounded to nearest once. Both are
reductions: nothing is returned, so the hardware need not send the old value back.

In the CUDA simulator the same names decode with NumPy and add in float64
(exact for two fp16 values), rounding once to fp16 as the hardware; the
atomics hold a lock, as the simulator's own atomics do.
"""

from ..runtime.backend import SIMULATOR

if SIMULATOR:
    import threading

    import numpy as np

    _lock = threading.Lock()

    def _halves(*words):
        return (np.array(words, np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.float16).astype(np.float64)

    def add_half2(a, b):
        halves = _halves(a, b)
        sums = (halves[:2] + halves[2:]).astype(np.float16)
        return np.int32(sums.view(np.int32)[0])

    def floats_of_half2(word):
        low, high = np.array([word], np.int64).astype(np.uint32).view(np.float16).astype(np.float32)
        return low, high

    def half2_of_floats(lo, hi):
        return np.int32(np.array([lo, hi], np.float32).astype(np.float16).view(np.int32)[0])

    def greater_mask_half2(a, b):
        halves = _halves(a, b)
        masks = np.where(halves[:2] > halves[2:], 0xFFFF, 0).astype(np.uint32)
        return np.uint32(masks[0] | masks[1] << 16)

    def half2_down(value):
        with np.errstate(over="ignore"):
            h = np.float16(np.float32(value))
        if h > np.float32(value):  # (rounded up, or to +inf past 65504: one step down)
            h = np.nextafter(h, np.float16(-np.inf))
        bits = int(np.array([h], np.float16).view(np.uint16)[0])
        return np.uint32(bits | bits << 16)

    def bf16_of_float(value):
        u = int(np.array([value], np.float32).view(np.uint32)[0])
        if value != value:
            return np.int16(0x7FFF)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        return np.array([r], np.uint16).view(np.int16)[0]

    def atomic_add_half(array, index, value):
        array = np.asarray(array)
        with _lock:
            array[index] = np.float16(np.float64(array[index]) + np.float64(value))

    def atomic_add_half2(words, index, word):
        words = np.asarray(words)
        with _lock:
            words[index] = add_half2(words[index], word)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import element_pointer, indexes

    def _words_op(instruction, result=None):
        """An intrinsic ``op(a, b)`` of two 32-bit words, one instruction ``instruction d, a, b``,
        returning a word of ``result``'s type (a's where None)."""

        @intrinsic
        def op(typingctx, a, b):
            if not (isinstance(a, types.Integer) and isinstance(b, types.Integer) and a.bitwidth == b.bitwidth == 32):
                return None

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), f"{instruction} $0, $1, $2;", "=r,r,r")
                return builder.call(asm, list(args))

            return (result or a)(a, b), codegen

        return op

    add_half2 = _words_op("add.rn.f16x2")
    greater_mask_half2 = _words_op("set.gt.u32.f16x2", types.uint32)

    @intrinsic
    def floats_of_half2(typingctx, word):
        if not (isinstance(word, types.Integer) and word.bitwidth == 32):
            return None

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            pair = ir.LiteralStructType([f32, f32])
            asm = ir.InlineAsm(ir.FunctionType(pair, [i32]),
                               "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                               "=f,=f,r")
            both = builder.call(asm, list(args))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(both, 0), builder.extract_value(both, 1)])

        return types.UniTuple(types.float32, 2)(word), codegen

    @intrinsic
    def half2_of_floats(typingctx, lo, hi):
        if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            values = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            # cvt.rn.f16x2.f32 d, a, b puts a in d's upper half and b in its lower half
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(asm, values)

        return types.int32(lo, hi), codegen

    @intrinsic
    def half2_down(typingctx, value):
        if not isinstance(value, types.Float):
            return None

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            value = context.cast(builder, args[0], sig.args[0], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32]),
                               "{ .reg .b16 h; cvt.rm.f16.f32 h, $1; mov.b32 $0, {h, h}; }", "=r,f")
            return builder.call(asm, [value])

        return types.uint32(value), codegen

    @intrinsic
    def bf16_of_float(typingctx, value):
        if not isinstance(value, types.Float):
            return None

        def codegen(context, builder, sig, args):
            f32 = context.cast(builder, args[0], sig.args[0], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [ir.FloatType()]), "cvt.rn.bf16.f32 $0, $1;", "=h,f")
            return builder.call(asm, [f32])

        return types.int16(value), codegen

    def _reduction(instruction, value_bits, constraint, accepts):
        """An intrinsic ``f(array, index, value)`` emitting ``instruction [&array[index]], value``."""

        @intrinsic
        def reduce(typingctx, array, index, value):
            if not (indexes(array, index) and accepts(array.dtype, value)):
                return None

            def codegen(context, builder, sig, args):
                pointer = element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                address = builder.ptrtoint(pointer, ir.IntType(64))
                bits = builder.bitcast(args[2], ir.IntType(value_bits))
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(value_bits)]),
                                   f"{instruction} [$0], $1;", f"l,{constraint},~{{memory}}", side_effect=True)
                builder.call(asm, [address, bits])
                return context.get_dummy_value()

            return types.none(array, index, value), codegen

        return reduce

    atomic_add_half = _reduction("red.global.add.noftz.f16", 16, "h",
                                 lambda dtype, value: dtype == value == types.float16)
    atomic_add_half2 = _reduction(
        "red.global.add.noftz.f16x2", 32, "r",
        lambda dtype, value: dtype == types.int32 and isinstance(value, types.Integer) and value.bitwidth == 32)


def stored_as(storage):
    """The device function that turns a float32 into what an output array of ``storage`` holds:
    bf16's bits (`bf16_of_float`, ``cvt.rn.bf16.f32``), else the value itself (an fp16 store
    converts it)."""
    if storage == "bfloat16":
        return bf16_of_float
    from ..runtime.compile import inlined

    @inlined
    def same(value):
        return value

    return same
