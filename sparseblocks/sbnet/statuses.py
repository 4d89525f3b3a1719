"""Status buffers of reduce_mask's one-pass kernel, one a stream (or a stream of a graph capture).

Statuses carry their launch's tag (status[0] + 1; each launch's last chunk advances
status[0]), so a buffer zeroed once serves every later launch that cannot run beside
another on it: one a stream, and one a stream of a graph capture (a graph's replays run in
order). A capture cannot zero a buffer without putting the fill in the graph, so it takes
one zeroed and synchronized by an earlier call outside any capture (a spare); where none is
left, the call zeroes scratch statuses. Buffers are kept for the process: a graph may be
replayed at any time.
"""

import numpy as np
from numba import cuda

from ..runtime.backend import SIMULATOR
from ..runtime.devices import active
from ..runtime.launch import capture_of, stream_handle, stream_of
from .dispatch import zero

# A stream destroyed with a launch still pending, whose handle a new stream gets before that launch
# ends, would share a buffer with it: torch never destroys its pooled streams.
_status_buffers = {}  # (stream handle or (capture id, handle), words) -> statuses (on the stream's device)


_status_spares = {}  # (words, device) -> [zeroed statuses for the next capture]


def _zeroed_statuses(words, stream):
    statuses = cuda.device_array(words, np.int64, stream=stream)
    zero(statuses, stream)
    return statuses


def _statuses(words, stream):
    """Kept statuses (`words` of them) for a version-2 launch on `stream` (a Numba stream or a
    raw handle), or None: zero scratch ones (a capture with no spare left)."""
    handle = stream if isinstance(stream, int) else stream_handle(stream)
    capture = capture_of(handle)
    spare = (words, active())  # (every device its own: handle 0 is each device's default stream)
    if capture is None:
        numba_stream = stream_of(handle) if isinstance(stream, int) and not SIMULATOR else stream
        if not _status_spares.get(spare):  # one for a capture to come, zeroed by then
            _status_spares[spare] = [_zeroed_statuses(words, numba_stream)]
            if not SIMULATOR:
                numba_stream.synchronize()  # (the capture may go on another stream)
        key = (handle, spare)
        if key not in _status_buffers:  # zeroed on the stream itself: before this launch, once
            _status_buffers[key] = _zeroed_statuses(words, numba_stream)
        return _status_buffers[key]
    key = ((capture, handle), spare)
    if key not in _status_buffers:
        spares = _status_spares.get(spare)
        if capture == -1 or not spares:
            return None
        _status_buffers[key] = spares.pop()
    return _status_buffers[key]
