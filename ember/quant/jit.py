"""numba as the kernels import it (`from ember.quant.jit import njit, types, intrinsic`), and
what the JIT costs in memory once the kernels are loaded.

numba needs LLVM (llvmlite's one shared library, ~100 MB on disk) to compile the kernels or to load and
link them from its cache; after that the kernels are plain machine code and LLVM is not called again
unless something new must be compiled. Two costs are avoidable:

* `release_compiler_pages()`: the pages of LLVM's code and read-only data that loading touched stay
  mapped in this process. Measured on SmolLM2 (warm cache): 51 MB of code and 17 MB of read-only data
  resident after load, none of it touched again by prefill, decode or short prompts. They are
  file-backed and clean, so ember asks the kernel to reclaim them (`madvise(MADV_PAGEOUT)`, Linux 5.4
  and later). Nothing is lost: a later compilation faults them back in from the file. Pages another
  process also maps are left alone by the kernel, as are modified (private dirty) ones.
* `numba_without_scipy_linalg()`, around the start of numba's CPU target below: when the target
  starts it imports `scipy.linalg` if SciPy is installed, only to learn whether `np.dot` inside jitted
  code can call BLAS. ember's kernels never do; the import costs 17 MB resident (SciPy's own OpenBLAS
  among it) and ~240 modules. Inside the block the probe finds no `scipy.linalg`, so numba records "no
  BLAS" for this process; afterwards `import scipy.linalg` works as usual. The one consequence: other
  jitted code in the same process cannot use `np.dot` / `np.linalg` (numba says SciPy is needed).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

MADV_PAGEOUT = 21  # <linux/mman.h>, Linux 5.4
_LIBRARY = "libllvmlite"


def compiler_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's read-only mappings of llvmlite's library."""
    mappings = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and _LIBRARY in os.path.basename(fields[5]) and "w" not in fields[1]:
                    start, end = (int(value, 16) for value in fields[0].split("-"))
                    mappings.append((start, end))
    except OSError:  # not Linux: nothing to release
        return []
    return mappings


def release_compiler_pages() -> int:
    """Ask the kernel to reclaim LLVM's resident code and read-only pages; return the bytes asked for
    (0 where the system has no MADV_PAGEOUT or llvmlite is not loaded). Never raises."""
    mappings = compiler_mappings()
    if not mappings:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    released = 0
    for start, end in mappings:
        if madvise(start, end - start, MADV_PAGEOUT) == 0:  # EINVAL before Linux 5.4: keep the pages
            released += end - start
    return released


@contextmanager
def numba_without_scipy_linalg() -> Iterator[None]:
    """Start numba's CPU target inside this block so that it does not import scipy.linalg (see the
    module's docstring); a no-op when scipy.linalg is already imported."""
    if "scipy.linalg" in sys.modules:
        yield
        return
    sys.modules["scipy.linalg"] = None  # type: ignore[assignment]  # `import scipy.linalg…` → ImportError
    try:
        yield
    finally:
        if sys.modules.get("scipy.linalg", 0) is None:
            del sys.modules["scipy.linalg"]


def _use_ember_cache() -> None:
    """numba's cache in `ember.quant.jit_cache_dir()` (unless NUMBA_CACHE_DIR is set) for every import
    of the kernels, not only `load_model`'s: a test or script importing `ember.quant.kernels` directly
    used numba's own cache beside the sources, keyed by each kernel's own file, which after an edit to
    simd.py alone loaded the old machine code (the stale code the digest-named folder prevents)."""
    from ember.quant import jit_cache_dir

    if "NUMBA_CACHE_DIR" in os.environ:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(jit_cache_dir())
    if "numba" in sys.modules:  # numba read its settings at its import: read them again
        from numba.core import config

        config.reload_config()


_use_ember_cache()
with numba_without_scipy_linalg():
    from numba import njit, types
    from numba.core import cgutils
    from numba.core.registry import cpu_target
    from numba.extending import intrinsic

    cpu_target.target_context.refresh()  # the CPU target's registries, scipy's probe among them



COMPILING = ("compiling ember's kernels for this machine (once: about 20 s, a minute or more on a busy "
             "machine; later loads reuse the compiled code)")


@contextmanager
def announce_compilation(stream: TextIO | None = None) -> Iterator[None]:
    """Say on stderr, once, that the kernels are compiling, and how long that took, when a kernel
    called inside the block actually compiles (numba's cache is cold or stale); kernels loaded from the
    cache say nothing. Plain lines, not a bar: a caller's spinner may be on screen (rich shows the lines
    above it)."""
    import time

    from numba.core import event

    started: list[float] = []

    def say(text: str) -> None:
        print(f"ember: {text}", file=stream or sys.stderr, flush=True)

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            if not started:
                started.append(time.perf_counter())
                say(f"{COMPILING} ...")

        def on_end(self, ev: event.Event) -> None:
            pass

    with event.install_listener("numba:compile", Listener()):
        yield
    if started:
        say(f"kernels compiled in {time.perf_counter() - started[0]:.0f} s")


__all__ = ["announce_compilation", "cgutils", "intrinsic", "njit", "release_compiler_pages", "types"]
