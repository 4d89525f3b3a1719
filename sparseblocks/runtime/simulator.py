"""Warp intrinsics for Numba's CUDA simulator.

Numba's simulator runs one Python thread per CUDA thread but implements none
of the warp-level intrinsics, so a kernel that uses them cannot run on a
machine without a GPU. `install()` adds them to the simulator's fake ``cuda``
module with real rendezvous semantics:

* ``shfl_sync``, ``shfl_up_sync``, ``shfl_down_sync``, ``shfl_xor_sync``,
  ``ballot_sync``, ``all_sync``, ``any_sync``, ``eq_sync``,
  ``match_any_sync``, ``match_all_sync`` and ``syncwarp`` are collectives over
  the lanes named in ``mask``: each calling lane waits until every lane of the
  mask has made the same call, then sees the values its peers held at that
  call. Source-lane arithmetic follows PTX ``shfl.sync`` with width 32 (the
  only width Numba exposes): ``delta`` and ``lane_mask`` use their low five
  bits, and a lane whose source falls outside the warp reads its own value.
  Reading from a lane that is not in ``mask`` is undefined on the GPU; here it
  returns a poison value (NaN, or ``0xDEADBEEF`` for integers) so that code
  which uses such a value fails its tests instead of passing by luck.
* ``activemask()`` returns the lanes of the warp that reach the call
  together: the caller waits until every other lane of its warp has arrived,
  exited, or blocked elsewhere (``syncthreads`` or another collective).
* ``lanemask_lt()`` is ``(1 << laneid) - 1``.

The libdevice bit casts ``int_as_float`` and ``float_as_int`` (stubs that
return None in the simulator) get NumPy implementations too, and so do the fast
approximations ``fast_expf`` and ``fast_fdividef``, as float32 operations with
IEEE's inf and NaN (the GPU's are within a few ulp of them).

Return types follow Numba's typing on the GPU (``ballot_sync`` and
``match_any_sync`` give int32, ``activemask`` and ``lanemask_lt`` uint32) as
NumPy scalars, so bit patterns and later arithmetic match the GPU. ``popc`` is
replaced too: the simulator's own counts the bits of ``abs(x)`` for negative x.

Misuse that would hang or be undefined on the GPU raises instead: a lane
calling with a mask that does not contain it, lanes of one mask meeting at
different intrinsics, or a collective waiting on a lane that exited or sits in
``syncthreads``.

Lanes of partial warps that do not exist (a block of 40 threads has an
8-lane second warp) are left out of every collective, as on the GPU.
"""

import sys
import threading

import numpy as np
from numba.cuda import types
from numba.cuda.np import numpy_support

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
# How often a waiting lane re-checks for deadlock and abort (seconds).
_POLL_S = 0.002
_POISON_INT = 0xDEADBEEF


class WarpCollectiveError(RuntimeError):
    """A warp collective was used in a way that is undefined or hangs on a GPU."""


class _Meeting:
    """One execution of one collective by a group of lanes (or threads)."""

    def __init__(self, op, key, lock):
        self.op = op
        self.key = key  # its room's key: a lane mask, or (size, group) of a group of threads
        self.values = {}
        self.done = False
        # Its own condition on the block's lock: completing it wakes its members only (one
        # condition for the whole block woke every waiting thread of the block each time).
        self.cond = threading.Condition(lock)


class _WarpRoom:
    """Rendezvous state of one warp."""

    def __init__(self, lanes):
        self.lanes = lanes  # lanes that exist in this warp
        self.by_mask = {}  # mask -> open _Meeting of a masked collective
        self.active = None  # open _Meeting of activemask()


class _BlockWarps:
    """Per simulated thread block: its threads by linear id and its warps."""

    def __init__(self, block_dim):
        self.n_threads = int(np.prod(block_dim))
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # (held while meetings change; its waits are theirs)
        self.threads = {}
        self.rooms = {}
        self.groups = {}  # (size, group) -> open _Meeting of a group collective (a warpgroup's)
        self.mbarriers = {}  # shared byte address -> [arrivals a phase, arrivals pending, phase, bytes pending]
        self.named = {}  # named barrier id -> [threads arrived, generation]

    def open_meetings(self):
        for room in self.rooms.values():
            yield from room.by_mask.values()
            if room.active is not None:
                yield room.active
        yield from self.groups.values()

    def room(self, warp):
        room = self.rooms.get(warp)
        if room is None:
            first = warp * WARP_SIZE
            lanes = frozenset(range(min(WARP_SIZE, self.n_threads - first)))
            room = self.rooms[warp] = _WarpRoom(lanes)
        return room


def _me():
    thread = threading.current_thread()
    if not hasattr(thread, "_sb_exited"):
        raise WarpCollectiveError("warp intrinsic called outside a simulated kernel")
    return thread


def _lane_state(block, warp, lane, me):
    """'exited', 'syncthreads', 'waiting', or 'running' for a lane of a warp, as `me` sees it."""
    thread = block.threads.get(warp * WARP_SIZE + lane)
    if thread is None:
        return "running"  # not started yet
    if thread._sb_exited:
        return "exited"
    if thread.syncthreads_blocked:
        # In a barrier `me` has already passed, the simulator is still releasing its threads
        # one by one: the lane is as good as running. In a later one it waits for real.
        return "running" if thread._sb_barriers <= me._sb_barriers else "syncthreads"
    if thread._sb_waiting is not None and not thread._sb_waiting.done:
        return "waiting"  # in a collective that has not completed yet
    return "running"


def _wait(block, me, meeting, settled):
    """Wait, holding block.cond, until `meeting` is done or ``settled(stalled)`` says so
    (``stalled``: a poll's wait ran out with no news, so look for members that will never come)."""
    me._sb_waiting = meeting
    try:
        stalled = False
        while not meeting.done:
            if settled(stalled):
                meeting.done = True
                meeting.cond.notify_all()
                break
            stalled = not meeting.cond.wait(_POLL_S)
            if me.abort:
                raise RuntimeError("abort flag set while waiting in a warp collective")
    finally:
        me._sb_waiting = None


def _meet(block, me, rooms, key, members, index, value, op, what, name, thread_of):
    """Under ``block.cond``: hand ``value`` in as member ``index`` of the open meeting
    ``rooms[key]`` of ``op`` (opened here if none is), wait until every one of ``members`` has,
    and return {member: value}. ``what`` and ``name`` ("lane", "thread") word the errors;
    ``thread_of(member)`` is its (warp, lane). Misuse that would hang on a GPU raises: another op
    met in the same room, a member that exited or waits in a barrier."""
    meeting = rooms.get(key)
    if meeting is None:
        meeting = rooms[key] = _Meeting(op, key, block.lock)
    elif meeting.op != op:
        raise WarpCollectiveError(f"{what}: {name} {index} called {op} while {name}s {sorted(meeting.values)} "
                                  f"wait in {meeting.op}")
    meeting.values[index] = value

    def settled(stalled):
        if members <= meeting.values.keys():
            if rooms.get(key) is meeting:
                del rooms[key]
            return True
        if not stalled:
            return False
        for other in members - meeting.values.keys():
            state = _lane_state(block, *thread_of(other), me)
            if state in ("exited", "syncthreads"):
                raise WarpCollectiveError(
                    f"{op}: {what}: {name} {other} {'exited' if state == 'exited' else 'waits in syncthreads'}"
                    f"; {name}s {sorted(meeting.values)} would wait forever")
        return False

    _wait(block, me, meeting, settled)
    return meeting.values


def _masked_collective(op, mask, value):
    """Meet the lanes of `mask`; return {lane: value} of every participant."""
    me = _me()
    block = me._manager._sb_warps
    warp, lane = divmod(me.thread_id, WARP_SIZE)
    mask = int(mask) & FULL_MASK
    if not (mask >> lane) & 1:
        raise WarpCollectiveError(
            f"{op}: lane {lane} of warp {warp} called with mask {mask:#010x}, "
            "which does not contain it"
        )
    with block.cond:
        room = block.room(warp)
        participants = frozenset(i for i in room.lanes if (mask >> i) & 1)
        values = _meet(block, me, room.by_mask, mask, participants, lane, value, op,
                       f"warp {warp}, mask {mask:#010x}", "lane", lambda other: (warp, other))
    return lane, values


def _group_collective(op, size, value):
    """Meet the threads of this thread's group of ``size`` consecutive threads (a warpgroup:
    128); return (this thread's index in the group, {index: value} of every member)."""
    me = _me()
    block = me._manager._sb_warps
    group, index = divmod(me.thread_id, size)
    with block.cond:
        members = frozenset(range(min(size, block.n_threads - group * size)))
        values = _meet(block, me, block.groups, (size, group), members, index, value, op,
                       f"group {group} of {size} threads", "thread",
                       lambda other: divmod(group * size + other, WARP_SIZE))
    return index, values


_STUCK_S = 120  # an mbarrier or named-barrier wait that long is a hang on the GPU too


def _block_wait(block, me, ready, what):
    """Wait, holding block.cond, until ``ready()``; raise where the block aborts or nothing
    changes for _STUCK_S seconds."""
    import time

    start = time.monotonic()
    while not ready():
        block.cond.wait(_POLL_S)
        if me.abort:
            raise RuntimeError(f"abort flag set while waiting in {what}")
        if time.monotonic() - start > _STUCK_S:
            raise WarpCollectiveError(f"{what}: waited {_STUCK_S} s; it would hang on the GPU")


def mbarrier_init(address, count):
    """``mbarrier.init``: the barrier at shared byte ``address`` expects ``count`` arrivals a phase,
    and its phase 0 is under way."""
    me = _me()
    block = me._manager._sb_warps
    if not 0 < int(count) < 1 << 20:
        raise WarpCollectiveError(f"mbarrier.init: count {count} outside 1 .. 2^20 - 1")
    with block.cond:
        block.mbarriers[int(address)] = [int(count), int(count), 0, 0]
        block.cond.notify_all()


def _mbarrier(block, address, what):
    state = block.mbarriers.get(int(address))
    if state is None:
        raise WarpCollectiveError(f"{what}: no mbarrier was initialized at this shared address")
    return state


def _mbarrier_update(address, what, arrivals, nbytes):
    """``arrivals`` arrivals and ``nbytes`` more bytes expected (fewer: landed) on the barrier at
    ``address``; a phase completes once its last arrival is in and its last expected byte has
    landed, and the next starts."""
    me = _me()
    block = me._manager._sb_warps
    with block.cond:
        state = _mbarrier(block, address, what)
        state[1] -= arrivals
        state[3] += nbytes
        if state[1] == 0 and state[3] == 0:
            state[1] = state[0]
            state[2] += 1
            block.cond.notify_all()


def mbarrier_arrive(address):
    """``mbarrier.arrive``: one arrival; the last of a phase completes it and starts the next."""
    _mbarrier_update(address, "mbarrier.arrive", 1, 0)


def mbarrier_expect_tx(address, nbytes):
    """``mbarrier.arrive.expect_tx``: the phase also waits for ``nbytes`` of copies; one arrival."""
    _mbarrier_update(address, "mbarrier.arrive.expect_tx", 1, int(nbytes))


def mbarrier_complete_tx(address, nbytes):
    """A bulk copy's ``nbytes`` have landed (``complete_tx``)."""
    _mbarrier_update(address, "complete_tx", 0, -int(nbytes))


def mbarrier_wait(address, parity):
    """``mbarrier.try_wait.parity`` in a loop: returns once the phase of parity ``parity`` (the
    current one or the one before it) has completed."""
    me = _me()
    block = me._manager._sb_warps
    with block.cond:
        state = _mbarrier(block, address, "mbarrier wait")
        _block_wait(block, me, lambda: state[2] % 2 != int(parity) % 2, "mbarrier wait")


def named_barrier(number, count):
    """``bar.sync number, count``: waits until ``count`` threads have arrived at barrier ``number``."""
    me = _me()
    block = me._manager._sb_warps
    if int(count) % WARP_SIZE or not 0 < int(count) <= block.n_threads:
        raise WarpCollectiveError(f"bar.sync {number}: count {count} is not a multiple of 32 up to the block's "
                                  f"{block.n_threads} threads")
    with block.cond:
        state = block.named.setdefault(int(number), [0, 0])
        state[0] += 1
        if state[0] == int(count):
            state[0] = 0
            state[1] += 1
            block.cond.notify_all()
            return
        generation = state[1]
        _block_wait(block, me, lambda: state[1] != generation, f"bar.sync {number}")


def block_lock():
    """The calling thread's block lock: what a collective whose result one member computes for
    all holds while it does, so that no member returns (and moves on to change shared memory the
    result is read from) before the result exists."""
    return _me()._manager._sb_warps.lock


def _poison(value):
    if isinstance(value, (float, np.floating)):
        return type(value)(np.nan)
    if isinstance(value, np.integer):
        return np.array(_POISON_INT).astype(value.dtype)[()]
    return _POISON_INT


# What Numba's typing lets a shuffle take on the GPU (`shfl_sync_intrinsic`: i4, i8, f4, f8; a
# Python int or float is typed i8 or f8 there): anything else, an unsigned or 16-bit int or a
# bool, fails to compile there, so it raises here too
_SHUFFLED = (int, float, np.int32, np.int64, np.float32, np.float64)


def _shuffle(op, mask, value, source_of):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, _SHUFFLED):
        raise TypeError(f"{op}: a value of {type(value).__name__}; the GPU's Numba shuffles only 32- and 64-bit "
                        "signed ints and floats")
    lane, values = _masked_collective(op, mask, value)
    source = source_of(lane)
    if not 0 <= source < WARP_SIZE:
        source = lane
    return values[source] if source in values else _poison(value)


def _bits(value):
    """Bit pattern of a shuffled value, so NaNs and -0.0 compare as on the GPU."""
    if isinstance(value, (float, np.floating)):
        return np.asarray(value).tobytes()
    return int(value)


def _lane_bits(lanes):
    return sum(1 << i for i in lanes)


def _int32(bits):
    return np.array(bits & FULL_MASK, dtype=np.uint32).view(np.int32)[()]


# The methods below are bound onto the simulator's FakeCUDAModule; `self` is
# the fake ``cuda`` module a simulated kernel sees.


def shfl_sync(self, mask, value, src_lane):
    return _shuffle("shfl_sync", mask, value, lambda lane: int(src_lane) & 31)


def shfl_up_sync(self, mask, value, delta):
    return _shuffle("shfl_up_sync", mask, value, lambda lane: lane - (int(delta) & 31))


def shfl_down_sync(self, mask, value, delta):
    return _shuffle("shfl_down_sync", mask, value, lambda lane: lane + (int(delta) & 31))


def shfl_xor_sync(self, mask, value, lane_mask):
    return _shuffle("shfl_xor_sync", mask, value, lambda lane: lane ^ (int(lane_mask) & 31))


def ballot_sync(self, mask, predicate):
    _, values = _masked_collective("ballot_sync", mask, bool(predicate))
    return _int32(_lane_bits(i for i, p in values.items() if p))


def all_sync(self, mask, predicate):
    _, values = _masked_collective("all_sync", mask, bool(predicate))
    return all(values.values())


def any_sync(self, mask, predicate):
    _, values = _masked_collective("any_sync", mask, bool(predicate))
    return any(values.values())


def eq_sync(self, mask, predicate):
    _, values = _masked_collective("eq_sync", mask, bool(predicate))
    return len(set(values.values())) == 1


def match_any_sync(self, mask, value):
    lane, values = _masked_collective("match_any_sync", mask, value)
    mine = _bits(value)
    return _int32(_lane_bits(i for i, v in values.items() if _bits(v) == mine))


def match_all_sync(self, mask, value):
    _, values = _masked_collective("match_all_sync", mask, value)
    same = len({_bits(v) for v in values.values()}) == 1
    return (_int32(_lane_bits(values)) if same else np.int32(0)), same


def syncwarp(self, mask=FULL_MASK):
    _masked_collective("syncwarp", mask, None)


def activemask(self):
    me = _me()
    block = me._manager._sb_warps
    warp, lane = divmod(me.thread_id, WARP_SIZE)
    with block.cond:
        room = block.room(warp)
        meeting = room.active
        if meeting is None:
            meeting = room.active = _Meeting("activemask", None, block.lock)
        meeting.values[lane] = True

        def settled(stalled):
            for other in room.lanes - meeting.values.keys():
                if _lane_state(block, warp, other, me) == "running":
                    return False
            if room.active is meeting:
                room.active = None
            return True

        _wait(block, me, meeting, settled)
    return np.uint32(_lane_bits(meeting.values))


def lanemask_lt(self):
    return np.uint32((1 << self.laneid) - 1)


def popc(self, value):
    if value < 0:
        width = value.dtype.itemsize * 8 if isinstance(value, np.integer) else (
            32 if value >= -(1 << 31) else 64
        )
        value = int(value) & ((1 << width) - 1)
    return bin(int(value)).count("1")


def _int_as_float(value):
    return np.int64(value).astype(np.uint32).view(np.float32)


def _float_as_int(value):
    return np.float32(value).view(np.int32)


def _fast_expf(value):
    with np.errstate(over="ignore"):
        return np.exp(np.float32(value))


def _fast_fdividef(a, b):
    with np.errstate(all="ignore"):
        return np.float32(a) / np.float32(b)


# libdevice bit casts, which the simulator leaves as stubs returning None, and fast approximations.
_LIBDEVICE = {"int_as_float": _int_as_float, "float_as_int": _float_as_int, "fast_expf": _fast_expf,
              "fast_fdividef": _fast_fdividef}

_INTRINSICS = (
    shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync,
    ballot_sync, all_sync, any_sync, eq_sync, match_any_sync, match_all_sync,
    syncwarp, activemask, lanemask_lt, popc,
)
_installed = False


class _Barrier:
    """A thread block's ``syncthreads``: the last live thread to arrive releases the others, and a
    thread that exits no longer counts. Numba's block manager instead polls every thread's flag
    in a loop, which holds the GIL for a pass over the block each time round."""

    def __init__(self, n_threads):
        self.cond = threading.Condition()
        self.live = n_threads
        self.arrived = 0
        self.generation = 0
        self.threads = []
        self.failed = None  # the first thread that raised
        self.finished = threading.Event()  # every thread has exited, or one raised

    def release(self):
        self.arrived = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self, thread):
        """``syncthreads`` for ``thread``."""
        with self.cond:
            thread.syncthreads_blocked = True
            self.arrived += 1
            if self.arrived >= self.live:
                self.release()
            else:
                generation = self.generation
                while self.generation == generation and not thread.abort:
                    self.cond.wait()
            thread.syncthreads_blocked = False

    def leave(self, thread):
        """``thread`` has exited (``thread.exception`` set where it raised)."""
        with self.cond:
            self.live -= 1
            if thread.exception and self.failed is None:
                self.failed = thread
                for other in self.threads:  # abort the rest (they raise at their next wait)
                    other.abort = True
                self.cond.notify_all()
                self.finished.set()
            elif self.arrived and self.arrived >= self.live:
                self.release()
            if self.live == 0:
                self.finished.set()


def _block_manager_run(self, grid_point, *args):
    """Numba's `BlockManager.run` (start every thread of the block, re-raise a thread's
    exception, without joining the others), its barrier a `_Barrier`."""
    from numba.cuda.simulator.kernel import BlockThread

    barrier = self._sb_barrier = _Barrier(int(np.prod(self._block_dim)))
    for block_point in np.ndindex(*self._block_dim):
        thread = BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
        with barrier.cond:
            barrier.threads.append(thread)
            thread.abort = barrier.failed is not None
        thread.start()
    barrier.finished.wait()
    if barrier.failed is not None:
        exception, traceback = barrier.failed.exception
        raise exception.with_traceback(traceback)


def _make_shared_array(numba_array):
    """Numba's ``cuda.shared.array`` for the simulator, which keys a static array by its caller's
    file and line, found through ``traceback.extract_stack``: that reads the source of every frame
    of the stack (a stat of each file), and it took most of the simulated threads' time. The
    caller's frame gives the same key directly."""

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # (errors, and dynamic shared memory: Numba's)
            return numba_array(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        held = self._allocations.get(caller)
        if held is None:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            held = self._allocations[caller] = np.empty(shape, dtype)
        return held

    return array


# Modules whose ``cuda`` names point at the running launch's fake module: {id(globals): (globals,
# names)}. Numba's simulator swaps a device function's module in and out around every call, under
# two locks, and scans the module's globals again whenever no other thread is inside it: a large
# share of a simulated thread's time in kernels built of small device functions. Here a module is
# swapped on its first call in a launch, and restored when the launch ends.
_launch_swaps = {}
_swap_lock = threading.Lock()


def _make_device_call(numba_call):
    from numba import cuda as real_cuda
    from numba.cuda.simulator import kernel

    def call(self, *args):
        fake = kernel._kernel_context
        if fake is None:  # (a launch, or a device function called from the host: Numba's way)
            return numba_call(self, *args)
        names = self.fn.__globals__
        if id(names) not in _launch_swaps:
            with _swap_lock:
                if id(names) not in _launch_swaps:
                    swapped = [name for name, value in names.items() if value is real_cuda]
                    for name in swapped:
                        names[name] = fake
                    _launch_swaps[id(names)] = (names, swapped)
        return self.fn(*args)

    return call


def _make_push_kernel_context(numba_push):
    from contextlib import contextmanager

    from numba import cuda as real_cuda

    @contextmanager
    def push(module):
        with numba_push(module):
            try:
                yield
            finally:
                with _swap_lock:
                    for names, swapped in _launch_swaps.values():
                        for name in swapped:
                            names[name] = real_cuda
                    _launch_swaps.clear()

    return push


def install():
    """Add the warp intrinsics to Numba's CUDA simulator (idempotent)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernel, kernelapi

    for function in _INTRINSICS:
        setattr(kernelapi.FakeCUDAModule, function.__name__, function)
    kernelapi.FakeCUDAShared.array = _make_shared_array(kernelapi.FakeCUDAShared.array)
    kernel.FakeCUDAKernel.__call__ = _make_device_call(kernel.FakeCUDAKernel.__call__)
    kernel._push_kernel_context = _make_push_kernel_context(kernel._push_kernel_context)
    from numba.cuda import libdevice

    for name, function in _LIBDEVICE.items():
        setattr(libdevice, name, function)

    manager_init = kernel.BlockManager.__init__
    thread_init = kernel.BlockThread.__init__
    thread_run = kernel.BlockThread.run

    def block_manager_init(self, f, grid_dim, block_dim, debug):
        manager_init(self, f, grid_dim, block_dim, debug)
        self._sb_warps = _BlockWarps(block_dim)

    def block_thread_init(self, f, manager, blockIdx, threadIdx, debug):
        thread_init(self, f, manager, blockIdx, threadIdx, debug)
        self._sb_exited = False
        self._sb_waiting = None
        self._sb_barriers = 0  # syncthreads entered so far
        with manager._sb_warps.cond:
            manager._sb_warps.threads[self.thread_id] = self

    def block_thread_run(self):
        try:
            thread_run(self)
        finally:
            warps = self._manager._sb_warps
            with warps.cond:
                self._sb_exited = True
                for meeting in list(warps.open_meetings()):  # (its waiters check for exited lanes)
                    meeting.cond.notify_all()
            self._manager._sb_barrier.leave(self)

    def block_thread_syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        self._sb_barriers += 1
        self._manager._sb_barrier.wait(self)
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    kernel.BlockManager.__init__ = block_manager_init
    kernel.BlockManager.run = _block_manager_run
    kernel.BlockThread.syncthreads = block_thread_syncthreads
    kernel.BlockThread.__init__ = block_thread_init
    kernel.BlockThread.run = block_thread_run
    _installed = True
