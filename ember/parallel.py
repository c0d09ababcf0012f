"""Work that ember shares out among its own threads, with BLAS kept to one thread inside.

A prefill's matrix products (tiles of W, `ember.quant.matrix`) and its attention (a KV head's queries
of one chunk, `ember.ops.attention`) are independent pieces. `share` runs them on `threads()` threads,
the calling thread and a kept pool, each piece calling single-threaded BLAS. No thread has a fixed
share: each takes the next piece nobody has taken as it frees up, and the caller does not wait for a
helper that has not started by the time the pieces are all done, so a thread whose core another
process took holds the others back by at most the piece it is in (README "How many threads").

Why not let BLAS (and numba) run their own threads: each pool busy-waits after its work (OpenBLAS's
idle threads spin, as do OpenMP's), and on 2 cores a spinning pool takes the core the next piece of
work needs. Measured on SmolLM2, 2 threads, 512-token prefill: 215 tokens/s with numba's parallel
decoder followed by 2-thread BLAS; a 1536×576 tile product took 5.4 ms on 2 ember threads right after
a 2-thread BLAS call (as slow as 1 thread) and 2.9 ms after single-threaded work.

`threads()` is set for a block by `ember.quant.compute_threads` (the model's `threads`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache

_threads = 1
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_inside = threading.local()  # set while a thread runs shared work: nested `share` calls run serially


def threads() -> int:
    """How many threads `share` uses (1 outside `use_threads`)."""
    return _threads


@contextmanager
def use_threads(count: int) -> Iterator[None]:
    global _threads
    saved, _threads = _threads, max(1, count)
    try:
        yield
    finally:
        _threads = saved


def _helpers(count: int) -> ThreadPoolExecutor:
    """The kept pool of `count` helper threads (starting threads for each product would cost more than
    a short prompt's product)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers != count:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(count, thread_name_prefix="ember")
        return _pool


def share(work: Callable[[int], None], count: int) -> None:
    """Run work(0), …, work(count − 1), each once, on up to `threads()` threads (the caller's among
    them) with single-threaded BLAS; return when all are done, raising the first error."""
    workers = min(threads(), count)
    if workers <= 1 or getattr(_inside, "active", False):
        with single_threaded_blas():
            for index in range(count):
                work(index)
        return
    pending = iter(range(count))
    lock = threading.Lock()

    def drain() -> None:  # the next piece nobody has taken, until none is left
        _inside.active = True
        try:
            while True:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                work(index)
        finally:
            _inside.active = False

    with single_threaded_blas():
        helpers = [_helpers(workers - 1).submit(drain) for _ in range(workers - 1)]
        try:
            drain()
        finally:
            for helper in helpers:
                if not helper.cancel():  # a helper that never started (its core taken) is not waited for
                    helper.result()


# Element-wise work over at least this many values is split among the threads (`share_ranges`): NumPy's
# ufuncs and the nogil kernels run in parallel. Measured on the 1B shape, 128-token prefill, 2 threads:
# SiLU alone took 2.3 ms a layer in one thread; a `share` costs ~20 µs.
SPLIT_VALUES = 1 << 16
# ... in pieces of about this many values (at most PIECES_PER_THREAD a thread), taken one by one as the
# threads free up: a thread that loses its core to another process holds back one small piece, not a
# fixed share. A piece costs a few µs of Python; 2^15 values of SiLU take tens.
PIECE_VALUES = 1 << 15
PIECES_PER_THREAD = 8


def share_ranges(count: int, values: int, work: Callable[[int, int], None]) -> None:
    """work(start, stop) over consecutive ranges covering range(count), each once, shared among the
    threads in pieces of about PIECE_VALUES values when the work touches at least SPLIT_VALUES values;
    else work(0, count) in this thread. Each range's values are computed as in one call over all (the
    work is element-wise by row), so the split changes no value."""
    workers = min(threads(), count)
    if values < SPLIT_VALUES or workers <= 1:
        work(0, count)
        return
    pieces = min(count, workers * PIECES_PER_THREAD, max(workers, values // PIECE_VALUES))
    share(lambda i: work(count * i // pieces, count * (i + 1) // pieces), pieces)


@cache
def _blas_libraries() -> tuple:
    from threadpoolctl import ThreadpoolController

    return tuple(lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas")


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS on one thread inside the block, restored after: each thread that calls it then multiplies in
    its own thread. A direct call into the BLAS library, a few microseconds (a `threadpool_limits` takes
    10-30)."""
    libraries = _blas_libraries()
    previous = [lib.num_threads for lib in libraries]
    for lib in libraries:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, count in zip(libraries, previous, strict=True):
            lib.set_num_threads(count)
