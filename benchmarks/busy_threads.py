"""2 threads against 1, on an idle machine and with one core kept busy by another process (a Python spin
loop this benchmark starts and stops itself), phase by phase on SmolLM2: a 5-token evaluation (a
study's short prompt), 128- and 256-token prefills (the proxy for a batch of 100-300 rows) and a
24-token decode, all in tokens/s, medians.

Each (threads, state) runs in a process of its own, and the order alternates round by round (idle then
busy, busy then idle; 1 then 2 threads, 2 then 1), so that a change in the rest of the machine's load
falls on all of them alike. `--baseline DIR` runs the same workers on another checkout of ember too
(its `ember` first on the path), for a before/after on the same machine in the same rounds. Report the
medians over the rounds, and say what else ran.

    python -m benchmarks.busy_threads --rounds 3 [--busy-core | --idle] [--baseline DIR] [--json out.json]
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
PHASES = {"evaluate 5": "tokens/s", "prefill 128": "tokens/s", "prefill 256": "tokens/s",
          "decode": "tokens/s"}
ROOT = Path(__file__).resolve().parent.parent


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
    import ember

    model = ember.load_model(MODEL, context_length=512, threads=threads)
    ids = model.tokenize(PROMPT)
    model.evaluate((ids * 30)[:256])  # warm: kernels, buffers

    def prompt_rate(tokens: list[int], repeats: int) -> float:
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            model.evaluate(tokens)
            rates.append(len(tokens) / (time.perf_counter() - started))
        return statistics.median(rates)

    result = {"threads": model.threads,
              "evaluate 5": prompt_rate(ids[:5], 9),
              "prefill 128": prompt_rate((ids * 30)[:128], 5),
              "prefill 256": prompt_rate((ids * 30)[:256], 3)}
    decode = []
    for _ in range(3):
        generation = model.generate(ids[:5], max_new_tokens=24, temperature=0.0, add_bos=False,
                                    stop_at_eog=False)
        decode.append(generation.timings.decode_tokens_per_second)
    result["decode"] = statistics.median(decode)
    return result


def run_one(threads: int, code: Path) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(threads)],
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(results: list[dict[str, Any]], phase: str) -> float | None:
    good = [r[phase] for r in results if "error" not in r]
    return statistics.median(good) if good else None


def table(results: dict[str, dict[str, dict[int, list[dict[str, Any]]]]], states: list[str]) -> str:
    """Per code and phase: 1 thread, 2 threads and their ratio, for each state."""
    lines = []
    for code, by_state in results.items():
        lines.append(f"{code}:")
        header = "".join(f"   {state:>9}: 1 thr   2 thr  2/1" for state in states)
        lines.append(f"  {'tokens/s':12}{header}")
        for phase in PHASES:
            cells = []
            for state in states:
                one, two = (median_of(by_state[state][t], phase) for t in (1, 2))
                if one is None or two is None:
                    cells.append(f"   {state:>9}: failed")
                    continue
                cells.append(f"   {'':>9}  {one:6.1f}  {two:6.1f} {two / one:4.2f}")
            lines.append(f"  {phase:12}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times each (threads, state) runs")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--busy-core", action="store_true", help="only with one core kept busy")
    only.add_argument("--idle", action="store_true", help="only without the busy process")
    parser.add_argument("--baseline", default=None, help="another ember checkout to measure alike")
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker)))
        return
    states = ["busy"] if args.busy_core else ["idle"] if args.idle else ["idle", "busy"]
    codes = {"this checkout": ROOT}
    if args.baseline:
        codes["baseline"] = Path(args.baseline).resolve()
    results = {code: {state: {1: [], 2: []} for state in states} for code in codes}
    started = time.time()
    for round_number in range(args.rounds):
        forward = round_number % 2 == 0
        for state in states if forward else states[::-1]:
            with busy_core(state == "busy"):
                for code in codes if forward else list(codes)[::-1]:
                    for threads in (1, 2) if forward else (2, 1):
                        result = run_one(threads, codes[code])
                        results[code][state][threads].append(result)
                        print(f"round {round_number + 1} {state:4} {code} {threads} thread(s) {result}",
                              file=sys.stderr, flush=True)
    print(f"\nSmolLM2, tokens/s, medians over {args.rounds} rounds ({time.time() - started:.0f} s, load "
          f"average {os.getloadavg()[0]:.1f} at the end; busy: one core kept busy by a spin loop)")
    print(table(results, states))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "model": MODEL,
                                               "codes": {k: str(v) for k, v in codes.items()},
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
