"""The JIT after load: every kernel variant the engine calls is loaded at load (nothing compiles at the
first token), numba started without scipy.linalg, LLVM's pages handed back, and compiling still works
after that. Each check runs in a fresh process, whose dispatchers start with no compiled variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, sys
import numpy as np
import ember
from numba.core.dispatcher import Dispatcher
from ember.quant import kernels, token_ops

def variants():
    return {f"{module.__name__}.{name}": [str(s) for s in getattr(module, name).signatures]
            for module in (kernels, token_ops) for name in dir(module)
            if isinstance(getattr(module, name), Dispatcher)}

report = {}
for path in sys.argv[1:]:
    model = ember.load_model(path, context_length=1024, threads=2)
    loaded = variants()
    ids = [int(i) for i in np.random.default_rng(0).integers(100, 40000, 600)]
    for length in (1, 40, 600):  # decode, a short prompt, tiles and (Gemma 3) past the 512 window
        model.generate(ids[:length], max_new_tokens=4, add_bos=False, stop_at_eog=False)
    after = variants()
    report[path] = {name: after[name] for name in after if after[name] != loaded.get(name)}

from ember.quant.jit import njit, release_compiler_pages
report["released"] = release_compiler_pages()
report["scipy.linalg imported"] = "scipy.linalg" in sys.modules
report["compiles after release"] = njit(lambda a: a * 2 + 1)(20)
import scipy.linalg
report["scipy.linalg importable"] = scipy.linalg.norm(np.ones(4)) == 2.0
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def child_report(smollm2_path, gemma3_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(smollm2_path), str(gemma3_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), (str(smollm2_path), str(gemma3_path))


def test_no_kernel_compiles_after_load(child_report):
    report, paths = child_report
    for path in paths:
        assert report[path] == {}, f"{path}: compiled after load: {report[path]}"


def test_numba_starts_without_scipy_linalg_and_scipy_still_imports(child_report):
    report, _ = child_report
    assert report["scipy.linalg imported"] is False
    assert report["scipy.linalg importable"] is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_llvm_pages_are_released_and_compiling_still_works(child_report):
    report, _ = child_report
    assert report["released"] > 10 * 2**20  # llvmlite's library maps ~100 MB read-only
    assert report["compiles after release"] == 41




def test_the_kernel_cache_is_named_by_every_kernel_source(tmp_path):
    # numba keys a cached kernel by its own file alone: an edit to simd.py or blocks.py must still name
    # another cache folder, or the old machine code is loaded.
    import shutil

    import ember.quant as quant

    sources = tmp_path / "quant"
    shutil.copytree(Path(quant.__file__).parent, sources)
    before = quant.jit_cache_dir(sources)
    assert before == quant.jit_cache_dir()  # the same sources, the same folder
    for name in quant.KERNEL_SOURCES:
        original = (sources / name).read_bytes()
        (sources / name).write_bytes(original + b"\n# changed\n")
        assert quant.jit_cache_dir(sources) != before, name
        (sources / name).write_bytes(original)
    assert quant.jit_cache_dir(sources) == before


@pytest.mark.parametrize("start", ["q.jit_unavailable()", "import numba, ember.quant.kernels as k"])
def test_a_fresh_process_points_numba_at_that_folder(tmp_path, start):
    # through load_model's check, and through importing the kernels directly (numba imported first)
    code = (f"import os, ember.quant as q; {start}; from numba.core import config; "
            "print(os.environ['NUMBA_CACHE_DIR'] == config.CACHE_DIR == str(q.jit_cache_dir()))")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, "EMBER_CACHE": str(tmp_path)})
    assert done.stdout.strip() == "True", done.stderr
