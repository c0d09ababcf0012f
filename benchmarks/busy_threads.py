"""2 threads against 1, with and without one core kept busy by another process, for numba's threading
settings: OpenMP's default spin (what numba picks here), OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT, and
the tbb layer (when a libtbb.so.12 is given). On SmolLM2: a 5-token evaluation (ms), a 64-token prefill
(tokens/s) and a 16-token decode (tokens/s), medians within a process.

Each setting runs in a process of its own (the OpenMP runtime reads its variables when it starts), and
the settings alternate round by round, idle and busy, so that a change in the rest of the machine's
load falls on all of them alike. Report the medians over the rounds, and say what else ran.

    python -m benchmarks.busy_threads --rounds 3 [--tbb-lib DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"
PROMPT = "The capital of France is Paris, and the capital of Germany is"


def settings(tbb_lib: str | None) -> dict[str, tuple[int, dict[str, str]]]:
    chosen = {
        "1 thread": (1, {}),
        "2 threads, omp (default)": (2, {}),
        "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
        "2 threads, GOMP_SPINCOUNT=3000": (2, {"GOMP_SPINCOUNT": "3000"}),
    }
    if tbb_lib:
        library_path = os.pathsep.join(p for p in (tbb_lib, os.environ.get("LD_LIBRARY_PATH")) if p)
        chosen["2 threads, tbb layer"] = (2, {"NUMBA_THREADING_LAYER": "tbb",
                                              "LD_LIBRARY_PATH": library_path})
    return chosen


@contextmanager
def busy_core(busy: bool = True) -> Iterator[None]:
    """One core kept busy by a spinning Python process for the block (nothing when `busy` is false)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def worker(threads: int) -> dict[str, Any]:
    import numba

    import ember

    model = ember.load_model(MODEL, context_length=512, threads=threads)
    ids = model.tokenize(PROMPT)
    short, long = ids[:5], (ids * 8)[:64]
    model.evaluate(long)  # warm
    evaluate, prefill, decode = [], [], []
    for _ in range(5):
        started = time.perf_counter()
        model.evaluate(short)
        evaluate.append((time.perf_counter() - started) * 1000)
    for _ in range(3):
        started = time.perf_counter()
        model.evaluate(long)
        prefill.append(len(long) / (time.perf_counter() - started))
    for _ in range(2):
        generation = model.generate(short, max_new_tokens=16, temperature=0.0, add_bos=False,
                                    stop_at_eog=False)
        decode.append(generation.timings.decode_tokens_per_second)
    return {"threads": model.threads, "layer": numba.threading_layer(),
            "evaluate_ms": statistics.median(evaluate), "prefill_tps": statistics.median(prefill),
            "decode_tps": statistics.median(decode)}


def run_one(threads: int, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.busy_threads", "--worker", str(threads)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times each setting runs, idle and busy")
    parser.add_argument("--tbb-lib", default=None, help="a folder holding libtbb.so.12 (pip's tbb wheel)")
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker)))
        return
    chosen = settings(args.tbb_lib)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {"idle": [], "busy": []}
                                                           for name in chosen}
    started = time.time()
    for round_number in range(args.rounds):
        for state in ("idle", "busy") if round_number % 2 == 0 else ("busy", "idle"):
            with busy_core(state == "busy"):
                names = list(chosen) if round_number % 2 == 0 else list(reversed(chosen))
                for name in names:
                    threads, env = chosen[name]
                    result = run_one(threads, env)
                    results[name][state].append(result)
                    print(f"round {round_number + 1} {state:4} {name:36} {result}", file=sys.stderr,
                          flush=True)
    print(f"\nSmolLM2, medians over {args.rounds} rounds ({time.time() - started:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f} at the end): evaluate 5 tokens ms / prefill 64 tok/s / decode tok/s")
    for name, states in results.items():
        cells = []
        for state in ("idle", "busy"):
            good = [r for r in states[state] if "error" not in r]
            if not good:
                cells.append(f"{state}: failed {states[state][0].get('error')}")
                continue
            figures = [statistics.median(r[key] for r in good)
                       for key in ("evaluate_ms", "prefill_tps", "decode_tps")]
            cells.append(f"{state}: {figures[0]:.0f} ms / {figures[1]:.0f} / {figures[2]:.1f}")
        print(f"  {name:36} " + "   ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
