"""How many BLAS threads should prefill and decode use? SmolLM2-sized products at 1 and 2 threads.

    python -m benchmarks.blas_threads                       # this machine's OpenBLAS settings
    python -m benchmarks.blas_threads --openblas-env unset  # without OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE

Each product is timed with the BLAS pool limited to 1 and to 2 threads (threadpoolctl), while the rest
of the machine is left alone ("idle"), or while this script keeps one core busy with a pure-Python spin
loop ("busy-spin") or with a single-threaded float32 matrix product ("busy-blas", like another test
run). Products are computed as the engine does (ember.ops.linear), `numpy.matmul(x, W.T, out=y)`
with W stored (out_features, in_features) and, for one token, x a vector:

* gemv, one token: W of 576x576 (q/o), 1536x576 (gate/up), 576x1536 (down), 49152x576 (LM head).
  Repeated on one matrix, so the weights stay in cache: this shows threading overhead.
* decode step: the 7 products of each of 30 layers, each layer with its own weights, then the LM head:
  every weight is streamed from memory once per token, as in real decode.
* gemm, a prompt: X of 128 or 512 tokens x 576 times W.T of 576x1536.

Times are per call: the mean (what throughput sees), the median and the 99th percentile of single calls.
Foreign load is what the rest of the machine used during a measurement, in cores (0 = really idle);
a measurement with more than 0.15 is repeated (up to 4 times) and the quietest attempt kept.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import threadpoolctl

from benchmarks.machine_load import LoadMeter, process_cpu_seconds, wait_for_quiet

OPENBLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
FOREIGN_LOAD_LIMIT = 0.15  # cores used by other processes above which a measurement is repeated
HIDDEN, FFN, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30

BUSY_SOURCES = {
    "busy-spin": "while True: pass",
    "busy-blas": (
        "import numpy as np, threadpoolctl\n"
        "threadpoolctl.threadpool_limits(1)\n"
        "a = np.ones((1024, 1024), np.float32)\n"
        "while True: a @ a\n"
    ),
}


def time_calls(function: Callable[[], object], seconds: float) -> dict[str, float]:
    """Single-call times in microseconds over about `seconds` of calls, after a warm-up."""
    for _ in range(3):
        function()
    samples = []
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        function()
        end = time.perf_counter()
        samples.append((end - start) * 1e6)
        if end > deadline and len(samples) >= 5:
            break
    samples.sort()
    return {
        "mean_us": statistics.fmean(samples),
        "median_us": samples[len(samples) // 2],
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "calls": len(samples),
    }


def quiet_measurement(
    function: Callable[[], object], seconds: float, helper: subprocess.Popen | None, attempts: int = 4
) -> dict[str, float]:
    """Time the calls, again if others used the machine meanwhile; keep the quietest attempt."""
    def own_seconds() -> float:
        own = process_cpu_seconds(os.getpid())
        return own + (process_cpu_seconds(helper.pid) if helper is not None else 0.0)

    best: dict[str, float] | None = None
    for _ in range(attempts):
        if helper is not None:  # the busy helper pauses while we wait, so as not to keep others waiting
            helper.send_signal(signal.SIGSTOP)
        wait_for_quiet(FOREIGN_LOAD_LIMIT, max_wait_seconds=600, own_seconds=own_seconds)
        if helper is not None:
            helper.send_signal(signal.SIGCONT)
            time.sleep(0.5)
        with LoadMeter(own_seconds) as meter:
            figures = time_calls(function, seconds)
        figures["foreign_cores"] = meter.foreign_cores
        if best is None or figures["foreign_cores"] < best["foreign_cores"]:
            best = figures
        if meter.foreign_cores < FOREIGN_LOAD_LIMIT:
            break
        time.sleep(2.0)
    assert best is not None
    return best


def build_cases(rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    def weights(out_features: int, in_features: int) -> np.ndarray:
        return rng.standard_normal((out_features, in_features), dtype=np.float32) * 0.05

    def product(x: np.ndarray, w: np.ndarray) -> Callable[[], object]:
        y = np.empty((*x.shape[:-1], w.shape[0]), np.float32)
        return lambda: np.matmul(x, w.T, out=y)

    cases: dict[str, Callable[[], object]] = {}
    for out_features, in_features in ((HIDDEN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN), (VOCAB, HIDDEN)):
        x = rng.standard_normal(in_features, dtype=np.float32)
        cases[f"gemv {out_features}x{in_features}"] = product(x, weights(out_features, in_features))

    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (FFN, HIDDEN), (FFN, HIDDEN),
              (HIDDEN, FFN)]
    layer_products = []
    for _ in range(LAYERS):
        for out_features, in_features in shapes:
            x = rng.standard_normal(in_features, dtype=np.float32)
            layer_products.append(product(x, weights(out_features, in_features)))
    head = product(rng.standard_normal(HIDDEN, dtype=np.float32), weights(VOCAB, HIDDEN))

    def decode_step() -> None:
        for call in layer_products:
            call()
        head()

    cases[f"decode step ({LAYERS} layers + head)"] = decode_step
    up = weights(FFN, HIDDEN)
    for tokens in (128, 512):
        x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
        cases[f"gemm {tokens}x{HIDDEN} @ {HIDDEN}x{FFN}"] = product(x, up)
    return cases


def measure(
    seconds: float,
    conditions: list[str],
    thread_counts: list[int],
    only: str | None,
    results: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fill `results[case][condition, threads]`, calling `save()` after each figure."""
    controller = threadpoolctl.ThreadpoolController()
    cases = build_cases(np.random.default_rng(0))
    if only:
        cases = {name: function for name, function in cases.items() if only in name}
    for condition in conditions:
        helper = None
        if condition != "idle":
            helper = subprocess.Popen([sys.executable, "-c", BUSY_SOURCES[condition]])
            time.sleep(1.0)
        try:
            for threads in thread_counts:
                with controller.limit(limits=threads, user_api="blas"):
                    for name, function in cases.items():
                        case_seconds = seconds * (3 if name.startswith("decode") else 1)
                        figures = quiet_measurement(function, case_seconds, helper)
                        results.setdefault(name, {})[f"{condition}, {threads} thread(s)"] = figures
                        save()
                        print(f"{condition:9} threads={threads} {name:34} mean {figures['mean_us']:9.1f} us"
                              f"  median {figures['median_us']:9.1f}  p99 {figures['p99_us']:9.1f}"
                              f"  foreign {figures['foreign_cores']:.2f} cores", flush=True)
        finally:
            if helper is not None:
                helper.kill()
                helper.wait()


def switch_cost_us(controller: threadpoolctl.ThreadpoolController) -> float:
    """Cost of one enter+exit of controller.limit(), as the engine would pay per phase."""
    start = time.perf_counter()
    for _ in range(200):
        with controller.limit(limits=1, user_api="blas"):
            pass
    return (time.perf_counter() - start) / 200 * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.blas_threads", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per product and setting")
    parser.add_argument("--conditions", default="idle,busy-spin,busy-blas")
    parser.add_argument("--threads", default="1,2", help="BLAS thread counts to compare")
    parser.add_argument("--only", help="measure only the products whose name contains this")
    parser.add_argument("--openblas-env", choices=("inherit", "unset"), default="inherit",
                        help=f"'unset' reruns this script without {' and '.join(OPENBLAS_VARIABLES)}")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    if args.openblas_env == "unset" and any(variable in os.environ for variable in OPENBLAS_VARIABLES):
        env = {key: value for key, value in os.environ.items() if key not in OPENBLAS_VARIABLES}
        arguments = argv if argv is not None else sys.argv[1:]
        command = [sys.executable, "-m", "benchmarks.blas_threads", *arguments]
        sys.exit(subprocess.call(command, env=env))

    controller = threadpoolctl.ThreadpoolController()
    blas = [info for info in controller.info() if info["user_api"] == "blas"]
    environment = {variable: os.environ.get(variable) for variable in OPENBLAS_VARIABLES}
    print(f"BLAS: {[(info['internal_api'], info['version'], info['architecture']) for info in blas]}; "
          f"env {environment}; load average {os.getloadavg()}")
    switch = switch_cost_us(controller)
    print(f"threadpoolctl limit() enter+exit: {switch:.0f} us")
    conditions = [condition.strip() for condition in args.conditions.split(",")]
    thread_counts = [int(count) for count in args.threads.split(",")]
    report: dict[str, Any] = {
        "blas": blas,
        "openblas_env": environment,
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_end": os.getloadavg(),
        "limit_switch_us": switch,
        "results": {},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def save() -> None:
        if args.json:
            report["load_average_end"] = os.getloadavg()
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    measure(args.seconds, conditions, thread_counts, args.only, report["results"], save)


if __name__ == "__main__":
    main()
