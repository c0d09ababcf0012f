"""Work that ember shares out among its own threads, with BLAS kept to one thread inside.

Every product and most element-wise work of a forward pass is made of independent pieces: a prefill's
tiles of W (`ember.quant.matrix`), its attention (a KV head's queries of one chunk, `ember.ops`),
ranges of rows of element-wise work (`share_ranges`), and in decode and short prompts the rows of W
themselves, which the numba kernels take a few at a time through an atomic counter
(`ember.quant.kernels.matvec`). `share` runs them on `threads()` threads, the calling thread and kept
helpers. No thread has a fixed share: each takes the next piece nobody has taken as it frees up, and
the caller does not wait for a helper that has not started by the time the pieces are all done. Work
whose pieces can be computed aside (`race`, `race_pieces`: every product, attention) does not wait
for a helper that took a piece and lost its core either: the caller takes that piece back, computes it
itself, and the helper's late values are dropped. Element-wise work done in place (`share_ranges`)
cannot be redone, so its caller waits, and a back-off runs it alone where sharing keeps losing. Helpers
keep off the caller's core (README "How many threads"). numba's own threads (prange) are not used:
under OpenMP they split a loop in fixed shares and spin at the barrier, and with the other core busy 2
threads decoded at 7-9 tokens/s where 1 decoded at 41-68.

The helpers wait on a C-level queue (no futures): a `share` of nothing costs ~5 µs on 2 idle threads,
20 with the BLAS limit set around it (which `blas=False` skips where no BLAS runs), against 35 on a
`concurrent.futures` pool.

Why not let BLAS run its own threads: each pool busy-waits after its work (OpenBLAS's idle threads
spin, as do OpenMP's), and on 2 cores a spinning pool takes the core the next piece of work needs.
Measured on SmolLM2, 2 threads, 512-token prefill: 215 tokens/s with numba's parallel decoder followed
by 2-thread BLAS; a 1536×576 tile product took 5.4 ms on 2 ember threads right after a 2-thread BLAS
call (as slow as 1 thread) and 2.9 ms after single-threaded work.

`threads()` is set for a block by `ember.quant.compute_threads` (the model's `threads`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import cache

import numpy as np

_threads = 1
_blas_threads = 1
_pool_lock = threading.Lock()
_inside = threading.local()  # set while a thread runs shared work: nested `share` calls run serially


def threads() -> int:
    """How many threads `share` uses (1 outside `use_threads`)."""
    return _threads


def blas_threads() -> int:
    """How many threads BLAS runs its own products on (1 unless `use_threads` says otherwise)."""
    return _blas_threads


@contextmanager
def use_threads(count: int, blas: int = 1) -> Iterator[None]:
    """`share` on `count` threads inside the block; `blas`: the threads BLAS is set to there, which
    its callers may rely on (the caller sets them)."""
    global _threads, _blas_threads
    saved = _threads, _blas_threads
    _threads, _blas_threads = max(1, count), max(1, blas)
    try:
        yield
    finally:
        _threads, _blas_threads = saved


class _Job:
    """One `share` call: its pieces, taken one by one by whichever thread asks next, and how many are
    finished. `next()` on the iterators is atomic under the GIL, so taking a piece needs no lock."""

    def __init__(self, work: Callable[[int], None], count: int) -> None:
        self.work = work
        self.count = count
        self.pieces = iter(range(count))
        self.finished = itertools.count(1)
        self.error: BaseException | None = None
        self.all_done = threading.Lock()
        self.all_done.acquire()  # released by the thread that finishes the last piece
        self.done = np.zeros(1, np.int64)  # ... which also sets this, for a caller watching it

    def drain(self) -> int:
        """Take and run pieces until none is left; return how many this thread ran."""
        _inside.active = True
        ran = 0
        try:
            for index in self.pieces:
                ran += 1
                try:
                    self.work(index)
                except BaseException as error:  # the caller raises it once every piece is done
                    if self.error is None:
                        self.error = error
                if next(self.finished) == self.count:
                    self.done[0] = 1
                    self.all_done.release()
        finally:
            _inside.active = False
        return ran


class _Backoff:
    """When sharing loses time, the next shares run in the calling thread alone for a while.

    Each share is weighed against the caller alone: having run `mine` of the `count` pieces in `worked`
    seconds of its own CPU time, the caller alone would have taken about worked · count / mine; the
    share took `took` (wall time, waiting for the helpers' last pieces included). The time sharing
    saved (negative: lost) and the time the work was worth are summed over the recent shares (decaying
    by DECAY a share), so a long wait on a helper whose core another process holds outweighs many
    small gains. When the recent shares lost more than LOST_SHARE of what they were worth, the next
    `period` shares run serially, then sharing is tried again; the period doubles each time sharing
    loses again (up to MAX_SERIAL) and halves each time a share saves time.

    Measured on SmolLM2 (Xeon, 2 cores, 2026-12-04; a 48-token decode and nine 5-token evaluations,
    ~3,000 shares): took / (caller alone) had quantiles 10/50/90/99% of 0.51/0.61/1.01/1.01 on the
    idle machine and 1.0/4.7/11.9/21.6 with the other core kept busy. Without the back-off, 2 threads
    decoded at 0.81-0.94× of 1 thread with a core busy. A longer memory (DECAY 0.95, ~20 shares) did no
    better: with a core busy, 2 threads / 1 of 0.75 in the 5-token evaluation, 0.88 and 0.95 in the
    prefills, 0.98 in decode and in residual patching (54 pairs), against 0.88, 0.96, 0.96, 0.98 and
    0.99 with 0.75 (single runs move by ±10% with the host's load). The clocks cost ~1 µs a share."""

    MIN_SERIAL = 64
    MAX_SERIAL = 1 << 14  # ~100 decode tokens of SmolLM2: a busy core is tried again every second or so
    DECAY = 0.75
    LOST_SHARE = 0.25

    def __init__(self) -> None:
        self.saved = 0.0
        self.worth = 0.0
        self.serial_left = 0
        self.period = self.MIN_SERIAL

    def serial(self) -> bool:
        """Whether this share runs serially (counting it off)."""
        if self.serial_left <= 0:
            return False
        self.serial_left -= 1
        return True

    def record(self, worked: float, took: float, mine: int, count: int) -> None:
        """One share's outcome (`worked`: the caller's CPU seconds on its `mine` pieces of `count`)."""
        if mine == 0 or worked <= 0.0:
            return
        alone = worked * count / mine
        self.saved = self.saved * self.DECAY + (alone - took)
        self.worth = self.worth * self.DECAY + alone
        if self.saved < -self.LOST_SHARE * self.worth:
            self.saved = self.worth = 0.0
            self.serial_left = self.period
            self.period = min(self.MAX_SERIAL, self.period * 2)
        elif took < alone:
            self.period = max(self.MIN_SERIAL, self.period // 2)


_backoff = _Backoff()


# Between shares a helper watches for the next job for HELPER_WATCH µs before it blocks on the queue,
# and a caller watches for its helpers' last piece for CALLER_WATCH µs before it blocks on the job's
# lock (`ember.quant.waiting`: numba, without the GIL; set by `use_waiting` once the kernels load).
# Blocked, each took a median 72 µs to wake (2-core Zen 3 VM). Decode hands out a share every 0.3-1 ms,
# its Python between shares (norms, routing) 0.1-0.3 ms.
HELPER_WATCH = 500.0
CALLER_WATCH = 2000.0
_waiting: Callable[[np.ndarray, int, float], bool] | None = None
_posted = np.zeros(1, np.int64)  # jobs handed to helpers so far


def use_waiting(wait_for_change: Callable[[np.ndarray, int, float], bool] | None) -> None:
    """Watch counters with `wait_for_change(counter, seen, microseconds)` before blocking (None: block at
    once, as where numba cannot run)."""
    global _waiting
    _waiting = wait_for_change


class _Watching:
    """Whether a helper watches for the next job before it blocks (HELPER_WATCH).

    A watching helper keeps a core. Where another process wants the other core, ember's two threads and
    that process share two cores, and a helper watching between shares takes time from that process or
    its own caller. So the helper times its watches, CPU time against wall time (summed over the recent
    ones, decaying by DECAY a watch): when it had its core less than ON_CORE of that time, it blocks at
    once for the next QUIET seconds, then watches again. Idle, a watch is on its core throughout."""

    ON_CORE = 0.9
    QUIET = 0.05
    DECAY = 0.8

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.quiet_until = 0.0

    def watch(self, seen: int) -> None:
        """Watch `_posted` move from `seen` for up to HELPER_WATCH µs, unless blocking at once for now."""
        started = time.perf_counter()
        if _waiting is None or started < self.quiet_until:
            return
        cpu_started = time.thread_time()
        _waiting(_posted, seen, HELPER_WATCH)
        self.wall = self.wall * self.DECAY + time.perf_counter() - started
        self.cpu = self.cpu * self.DECAY + time.thread_time() - cpu_started
        if self.cpu < self.ON_CORE * self.wall:
            self.quiet_until = time.perf_counter() + self.QUIET
            self.cpu = self.wall = 0.0


def _cpu_reader() -> Callable[[], int] | None:
    """The C library's sched_getcpu (the core the calling thread runs on, ~0.2 µs through ctypes), or
    None where there is none or threads cannot be placed (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None


_read_cpu = _cpu_reader()
_caller_cpu = -1  # the core the last caller of a share ran on when it handed the share out


def _note_caller_cpu() -> None:
    global _caller_cpu
    if _read_cpu is not None:
        _caller_cpu = _read_cpu()


class _Placement:
    """A helper keeps off the core its caller runs on (follows it when the caller moves).

    Where another process keeps one of two cores busy, ember's caller, its helper and that process
    share two cores. Left to the scheduler, a woken helper often lands on its caller's core, takes it
    from the caller for the share and gives the work no second core; kept off it, the helper shares the
    other core with the other process, and the caller keeps its own as with one thread. Measured on
    SmolLM2 (2-core Zen 3 VM, one core kept busy by a spin loop, 2026-12-07, 2 threads / 1 thread, one
    round each): helper and caller left to the scheduler: evaluate 5 tokens 0.74-0.91, decode 0.95-0.99;
    helper on the other core: 1.03 and 1.05."""

    def __init__(self) -> None:
        self.allowed = os.sched_getaffinity(0) if _read_cpu is not None else set()
        self.avoiding = -1

    def follow(self) -> None:
        """Move off the caller's core if it is not already (a system call only when the caller moved)."""
        cpu = _caller_cpu
        if cpu == self.avoiding or cpu < 0:
            return
        self.avoiding = cpu
        others = self.allowed - {cpu}
        if others:
            try:
                os.sched_setaffinity(0, others)
            except OSError:  # the process's cores changed under it (a cpuset, taskset): stop placing
                self.allowed = set()


def _helper(jobs: queue.SimpleQueue) -> None:
    watching = _Watching()
    placement = _Placement()
    while True:
        seen = int(_posted[0])
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            watching.watch(seen)
            job = jobs.get()
        placement.follow()
        job.drain()  # a job whose pieces are all taken by the time it is picked up: nothing to do


_jobs: queue.SimpleQueue = queue.SimpleQueue()
_helper_count = 0


def _wake_helpers(job: _Job, count: int) -> None:
    """Hand `job` to `count` helpers, starting helper threads the first time they are needed (kept for
    the process: starting one costs more than a short prompt's product)."""
    global _helper_count
    with _pool_lock:
        while _helper_count < count:
            name = f"ember-{_helper_count}"
            threading.Thread(target=_helper, args=(_jobs,), name=name, daemon=True).start()
            _helper_count += 1
    _note_caller_cpu()
    for _ in range(count):
        _jobs.put(job)
    _posted[0] += 1


def workers(count: int) -> int:
    """How many threads a share of `count` pieces runs on now: 1 inside shared work (nested shares run
    serially) or while sharing is backed off (`_Backoff`), else up to `threads()`. Asking counts as a
    share's turn: pass the answer to `share`."""
    if _threads <= 1 or count <= 1 or getattr(_inside, "active", False) or _backoff.serial():
        return 1
    return min(_threads, count)


def share(work: Callable[[int], None], count: int, blas: bool = True, *, on: int | None = None) -> None:
    """Run work(0), …, work(count − 1), each once, on up to `threads()` threads (the caller's among
    them; `on`: this many, as `workers` said), with single-threaded BLAS unless `blas` is False
    (work that calls no BLAS saves the few µs of setting it); return when all are done, raising the
    first error.

    The caller wakes the helpers (a C-level queue each waits on, ~10 µs) and takes pieces itself at
    once; a helper takes pieces from when it wakes. When every piece is done the caller returns without
    waiting for a helper that has not started: one whose core another process holds finds nothing left
    when it runs. A helper that took a piece and lost its core makes the caller wait; when that happens
    share after share, the next shares run in the calling thread alone for a while (`_Backoff`)."""
    workers_now = workers(count) if on is None else min(on, count)
    if workers_now <= 1:
        error = None
        with single_threaded_blas() if blas else nullcontext():
            for index in range(count):
                try:
                    work(index)
                except BaseException as raised:  # every piece runs, as when shared; the first error
                    error = error or raised
        if error is not None:
            raise error
        return
    job = _Job(work, count)
    with single_threaded_blas() if blas else nullcontext():
        started, cpu_started = time.perf_counter(), time.thread_time()
        _wake_helpers(job, workers_now - 1)
        mine = job.drain()
        worked = time.thread_time() - cpu_started
        if _waiting is not None and not job.done[0]:
            _waiting(job.done, 0, CALLER_WATCH)
        job.all_done.acquire()  # the pieces helpers took, finished
        _backoff.record(worked, time.perf_counter() - started, mine, count)
    if job.error is not None:
        raise job.error


def racers(count: int) -> int:
    """How many threads a `race` of `count` pieces runs on: 1 inside shared work, else up to `threads()`.
    No back-off: a race never waits on a helper for longer than its watch (`race`)."""
    if _threads <= 1 or count <= 1 or getattr(_inside, "active", False):
        return 1
    return min(_threads, count)


def race(work: Callable[[bool], None], on: int) -> _Job | None:
    """work(True) in the calling thread while `on` − 1 helpers each run work(False); return as soon as
    the caller's call returns, without waiting for any helper: the helpers' job (its `done` set once
    every helper's call has returned), or None if no helper was asked.

    For work that completes every piece in the caller's call whatever the helpers do: a helper computes
    its pieces aside and writes each where others read only once it has made sure the caller has not
    taken that piece back, the caller takes back the pieces a helper has not finished when none is left
    to take (`ember.quant.kernels.share_state`). So a helper that lost its core to another process costs the
    caller a short watch and one piece of its own work, never the other process's time slice, and its
    late values are dropped. A helper's error is dropped too: the caller computes that piece itself and
    meets the error there. While the helpers have not yet picked up the last race's job, the caller
    works alone."""
    if on <= 1 or _jobs.qsize() >= on - 1:
        work(True)
        return None
    job = _Job(lambda _: work(False), on - 1)
    _wake_helpers(job, on - 1)
    work(True)
    return job


# A piece's state in `race_pieces`, and in the numba kernels' products (`ember.quant.kernels.share_state`).
OPEN, COPYING, DONE, TAKEN = 0, 1, 2, 3
# When its pieces are all taken, a caller of `race_pieces` watches a helper's unfinished piece for up to
# this many µs before computing it itself: a prefill tile or a query chunk's attention takes 0.1-1 ms.
PIECE_WATCH = 1000.0


def race_pieces(count: int, compute: Callable[[int], object], store: Callable[[int, object], None],
                direct: Callable[[int], None] | None = None, blas: bool = True, *,
                on: int | None = None) -> None:
    """store(i, compute(i)) for i in range(count), each stored once, the pieces taken one by one by the
    calling thread and up to `threads()` − 1 helpers (`on`: at most this many threads) as in `race`.

    `compute` must write nothing another piece or a later step reads (its result lives in a fresh array
    or its thread's own scratch): a helper's result is stored only once the piece is the helper's, and
    dropped when the caller took the piece back. `direct(i)`, if given, does the caller's own pieces in
    one step (straight into the output). Returns when every piece is stored, having watched a helper's
    unfinished piece at most PIECE_WATCH µs before computing it itself; raises the caller's first error
    (a helper's errors are dropped: the caller takes those pieces back and meets them there)."""
    states = np.zeros(count, np.int64)
    pieces = iter(range(count))
    lock = threading.Lock()
    own = direct if direct is not None else (lambda index: store(index, compute(index)))

    def helper_piece(index: int) -> None:
        result = compute(index)
        with lock:
            mine = states[index] == OPEN
            if mine:
                states[index] = COPYING
        if mine:
            store(index, result)
            states[index] = DONE

    def caller_takes_back(index: int) -> bool:
        if _waiting is not None and states[index] == OPEN:
            _waiting(states[index:index + 1], OPEN, PIECE_WATCH)
        with lock:
            if states[index] == OPEN:
                states[index] = TAKEN
                return True
        while states[index] != DONE:  # being copied
            if _waiting is None or not _waiting(states[index:index + 1], COPYING, PIECE_WATCH):
                time.sleep(0)
        return False

    def close() -> None:  # the caller is leaving on an error: no helper may store after it
        with lock:
            states[states == OPEN] = TAKEN
        for index in np.flatnonzero(states == COPYING):
            while states[index] == COPYING:
                time.sleep(0)

    def work(caller: bool) -> None:
        was_inside = getattr(_inside, "active", False)
        _inside.active = True
        try:
            for index in pieces:
                if caller:
                    own(index)
                    states[index] = DONE
                else:
                    helper_piece(index)
            for index in range(count) if caller else ():
                if states[index] != DONE and caller_takes_back(index):
                    own(index)
        except BaseException:
            if caller:
                close()
            raise
        finally:
            _inside.active = was_inside

    with single_threaded_blas() if blas else nullcontext():
        race(work, racers(count) if on is None else min(on, racers(count)))


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
    threads_now = workers(count) if values >= SPLIT_VALUES else 1
    if threads_now <= 1:
        work(0, count)
        return
    pieces = min(count, threads_now * PIECES_PER_THREAD, max(threads_now, values // PIECE_VALUES))
    share(lambda i: work(count * i // pieces, count * (i + 1) // pieces), pieces, blas=False, on=threads_now)


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
