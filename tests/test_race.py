"""Products shared as races (`ember.parallel.race`, `ember.quant.kernels.OPEN`): the caller takes back
what a helper left unfinished, a late helper's values are dropped, helpers keep off their caller's core.

A helper that lost its core is stood in for by pieces marked taken that nobody computes, or by a helper
thread held on an event: nothing here depends on how fast the machine is."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_quant import random_encoded

from ember import parallel
from ember.quant import compute_threads, kernels, matrix, q8, waiting
from ember.quant.matrix import QuantizedActivation, QuantizedMatrix

RNG = np.random.default_rng(25)
ROWS, COLUMNS, PIECE = 80, 512, 16  # 5 pieces


def _weights(qtype: Q) -> QuantizedMatrix:
    return QuantizedMatrix("w", random_encoded(qtype, ROWS, COLUMNS), int(qtype), (ROWS, COLUMNS))


def _kernels() -> dict[str, tuple]:
    """name -> (call(state, out, caller), activation rows) for each product kernel."""
    plain = _weights(Q.Q4_1)
    group = matrix.kernel_groups([plain])[0]
    one = RNG.standard_normal((1, COLUMNS)).astype(np.float32)
    five = RNG.standard_normal((5, COLUMNS)).astype(np.float32)
    calls = {
        "matvec": (lambda state, out, caller: kernels.matvec(
            *group, one[0], out, kernels.F16_TABLE, state, PIECE, caller), 1),
        "matmul_rows": (lambda state, out, caller: kernels.matmul_rows(
            *group, five, out, kernels.F16_TABLE, matrix.HALF, state, PIECE, caller), 5),
    }
    if q8.AVAILABLE:
        for qtype, rounding in ((Q.Q4_K, "q8_k"), (Q.Q8_0, "q8_0")):
            rounded = matrix.kernel_groups([_weights(qtype)])[0]
            activation = QuantizedActivation(five, rounding)
            calls[f"q8 {qtype.name}"] = (lambda state, out, caller, rounded=rounded, activation=activation:
                                         activation.multiply(rounded, out, state, PIECE, caller), 5)
    return calls


KERNELS = _kernels()


def _alone(call, tokens: int) -> np.ndarray:
    out = np.full((tokens, ROWS), np.nan, np.float32)
    call(kernels.share_state(ROWS // PIECE, 0), out, True)
    return out


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_caller_takes_back_the_pieces_a_helper_took_and_never_finished(name):
    call, tokens = KERNELS[name]
    expected = _alone(call, tokens)
    assert not np.isnan(expected).any()
    state = kernels.share_state(ROWS // PIECE, patience=100)
    state[0] = 2  # pieces 0 and 1 were taken by a helper that lost its core
    out = np.full((tokens, ROWS), np.nan, np.float32)
    call(state, out, True)
    np.testing.assert_array_equal(out, expected)
    assert (state[2:] == kernels.DONE).all()  # taken back, computed, marked done


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_helper_that_runs_late_drops_the_pieces_its_caller_took_back(name):
    call, tokens = KERNELS[name]
    expected = _alone(call, tokens)
    state = kernels.share_state(ROWS // PIECE, patience=0)
    state[2 + 1] = kernels.TAKEN  # the caller computed piece 1 itself and returned
    out = np.full((tokens, ROWS), np.nan, np.float32)
    call(state, out, False)  # the helper gets its core back and goes through every piece
    assert np.isnan(out[:, PIECE:2 * PIECE]).all()  # never written
    keep = np.r_[0:PIECE, 2 * PIECE:ROWS]
    np.testing.assert_array_equal(out[:, keep], expected[:, keep])
    assert list(state[2:]) == [kernels.DONE, kernels.TAKEN] + [kernels.DONE] * 3


def test_a_product_returns_complete_while_its_helper_is_held_elsewhere(monkeypatch):
    """The helper is kept busy by another job until after the product: the caller computes every piece
    and returns (waiting for the helper would hang until the event's 120 s)."""
    monkeypatch.setattr(matrix, "SHARED_FROM", 1)
    weights = _weights(Q.Q4_1)
    x = RNG.standard_normal((1, COLUMNS)).astype(np.float32)
    expected = weights.matmul(x, np.empty((1, ROWS), np.float32)).copy()
    release, holding = threading.Event(), threading.Event()

    def held(_: int) -> None:
        holding.set()
        release.wait(120)

    with compute_threads(2):
        parallel.share(lambda index: None, 2)  # the helper thread exists
        job = parallel._Job(held, parallel._helper_count)
        parallel._wake_helpers(job, parallel._helper_count)
        assert holding.wait(60)
        try:
            for _ in range(3):
                out = np.full((1, ROWS), np.nan, np.float32)
                np.testing.assert_array_equal(weights.matmul(x, out), expected)
                assert not release.is_set()
        finally:
            release.set()


def test_a_helper_error_reaches_the_caller_through_the_piece_it_takes_back():
    def work(caller: bool) -> None:
        raise ValueError("caller" if caller else "helper")

    with compute_threads(2), pytest.raises(ValueError, match="caller"):
        parallel.race(work, 2)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores this process may run on")
def test_helpers_keep_off_the_core_their_caller_runs_on():
    with compute_threads(2):
        parallel.share(lambda index: None, 2)  # the helper exists
        helpers = [thread for thread in threading.enumerate() if thread.name.startswith("ember-")]
        deadline = time.monotonic() + 60
        while True:
            parallel.share(lambda index: time.sleep(0.001), 4)
            caller = parallel._caller_cpu
            placed = [os.sched_getaffinity(helper.native_id) for helper in helpers]
            if all(caller not in cpus for cpus in placed) or time.monotonic() > deadline:
                break
    assert caller >= 0
    assert all(caller not in cpus and cpus for cpus in placed)


def test_a_helper_whose_watch_was_spent_off_its_core_blocks_at_once_for_a_while(monkeypatch):
    """A watch that took wall time but no CPU time (here: a sleep; on a busy machine: the other
    process's turn on the core) makes the helper skip its watches for QUIET seconds."""
    watched = []

    def sleeping(counter: np.ndarray, seen: int, microseconds: float) -> bool:
        watched.append(microseconds)
        time.sleep(0.005)
        return False

    monkeypatch.setattr(parallel, "_waiting", sleeping)
    watching = parallel._Watching()
    watching.watch(0)
    assert len(watched) == 1 and watching.quiet_until > time.perf_counter()
    watching.watch(0)  # quiet: no watch
    assert len(watched) == 1
    watching.quiet_until = 0.0
    watching.watch(0)
    assert len(watched) == 2


def test_patience_is_a_watch_of_about_redo_watch_microseconds():
    waiting.warm_up()
    assert matrix._patience(1) == 0
    assert matrix._patience(2) == waiting.rounds(matrix.REDO_WATCH) >= 1
