"""Shared-memory barriers with phases (``mbarrier``), named barriers and register hand-over: what
a warp-specialized thread block, whose producer warps copy while its consumer warps multiply,
synchronizes with.

An mbarrier is 8 bytes of shared memory (at a multiple of 8) that counts arrivals. ``init(bar,
count)`` (one thread, then a barrier of the block) makes it expect ``count`` arrivals a phase; the
last arrival of a phase completes it and starts the next. Threads never wait for the whole block:

* ``arrive(bar)``: one arrival (release: this thread's earlier memory accesses are ordered before
  it);
* ``copy_arrive(bar)`` (``cp.async.mbarrier.arrive.noinc``): one arrival, made once every cp.async
  copy this thread has started has landed, so a consumer that waits on the barrier sees the
  copies; ``count`` counts these arrivals too (no increment of the pending count);
* ``wait(bar, parity)``: blocks until the phase of parity ``parity`` has completed (acquire). A
  ring of stages alternates the parity each time round: a consumer waits for parity 0 the first
  time round a stage's "full" barrier, 1 the second; a producer waits on a stage's "empty"
  barrier with the opposite parity, so that the first time round passes at once.

Shared tiles that the copies fill and ``wgmma`` reads still need ``wgmma.proxy_fence`` in the
reading thread after its wait (the copies are the generic proxy's, wgmma reads through the async
proxy).

``named_barrier(number, count)`` (``bar.sync``) is a barrier of the first ``count`` threads to
arrive at barrier ``number`` (1 to 15; 0 is ``syncthreads``'), for a subset of the warps such as the
consumer warpgroups. ``registers(count, increase)`` returns ``setmaxnreg``: a warpgroup gives
registers back (``increase`` false) or takes them (true), so that producer warps that need few
leave them to the consumers (sm_90a; the kernel must be built with a register cap, see
`runtime.compile.bounded`).

In the CUDA simulator the barriers live beside the thread block (`runtime.simulator`) and their
waits block the simulated thread; ``copy_arrive`` lands the thread's queued copies
(`ptx.cp_async`) and then arrives; ``registers`` does nothing. A wait that never completes raises
after two minutes instead of hanging.
"""

from ..runtime.backend import SIMULATOR

BYTES = 8  # an mbarrier


def _check_registers(count):
    if not (24 <= count <= 256 and count % 8 == 0):
        raise ValueError(f"registers: expected a multiple of 8 from 24 to 256, got {count}")


if SIMULATOR:
    from ..runtime import simulator as _simulator
    from .cp_async import _Address, _land
    from .cp_async import commit as _commit

    def _byte(bar, what):
        if not isinstance(bar, _Address):
            raise TypeError(f"{what}: expected a shared address (cp_async.shared_address)")
        if not 0 <= bar.offset <= len(bar.buffer) - BYTES:
            raise IndexError(f"{what}: bytes {bar.offset}..{bar.offset + BYTES} outside the shared array's "
                             f"{len(bar.buffer)}")
        at = bar.buffer.ctypes.data + bar.offset
        if at % BYTES:
            raise ValueError(f"{what}: address not aligned to {BYTES} bytes")
        return at

    def init(bar, count):
        _simulator.mbarrier_init(_byte(bar, "mbarrier.init"), count)

    def arrive(bar):
        _simulator.mbarrier_arrive(_byte(bar, "mbarrier.arrive"))

    def copy_arrive(bar):
        at = _byte(bar, "cp.async.mbarrier.arrive")
        _commit()
        _land(0)  # every copy this thread started has landed
        _simulator.mbarrier_arrive(at)

    def wait(bar, parity):
        _simulator.mbarrier_wait(_byte(bar, "mbarrier wait"), parity)

    def named_barrier(number, count):
        if not 1 <= int(number) <= 15:
            raise ValueError(f"named_barrier: number {number} outside 1..15")
        _simulator.named_barrier(number, count)

    def registers(count, increase):
        _check_registers(count)

        def setmaxnreg():
            return None

        return setmaxnreg

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .cp_async import statement

    I32 = ir.IntType(32)

    def _asm(ptx, operands):
        """An intrinsic emitting ``ptx`` (a side effect that orders memory) on ``operands`` integer
        arguments, each passed as a 32-bit register ($0, $1, ...)."""

        def typer(*args):
            return all(isinstance(a, (types.Integer, types.Boolean)) for a in args) and len(args) == operands

        def codegen(context, builder, sig, args):
            values = [context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args)]
            function = ir.FunctionType(ir.VoidType(), [I32] * operands)
            constraints = ",".join(["r"] * operands + ["~{memory}"])
            builder.call(ir.InlineAsm(function, ptx, constraints, side_effect=True), values)
            return context.get_dummy_value()

        if operands == 1:
            @intrinsic
            def emit(typingctx, a):
                return (types.void(a), codegen) if typer(a) else None
        else:
            @intrinsic
            def emit(typingctx, a, b):
                return (types.void(a, b), codegen) if typer(a, b) else None
        return emit

    init = _asm("mbarrier.init.shared::cta.b64 [$0], $1;", 2)
    arrive = _asm("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [$0]; }", 1)
    copy_arrive = _asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", 1)
    # (a label inside braces is local to them, so each inlined copy of the loop has its own)
    wait = _asm("{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
                "@!done bra WAIT; }", 2)
    named_barrier = _asm("bar.sync $0, $1;", 2)

    def registers(count, increase):
        """``setmaxnreg.inc`` / ``.dec`` to ``count`` registers a thread for this warpgroup."""
        _check_registers(count)
        return statement(f"setmaxnreg.{'inc' if increase else 'dec'}.sync.aligned.u32 {count};")
