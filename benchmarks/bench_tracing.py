"""What tracing costs: decode speed with tracing off, on, and on with layer spans, against an older engine.

    python -m benchmarks.bench_tracing                       # baseline: the engine before tracing (c93adaf^)
    python -m benchmarks.bench_tracing --base-rev HEAD~5 --rounds 30 --threads 2

The baseline's `ember/` is taken from git (`git archive`), renamed to `ember_base` and loaded in the same
process as the current engine, so both run the same GGUF file on the same machine in interleaved rounds:
a change in the machine's load hits both alike. Each round times one greedy generation per variant
(`--new-tokens` tokens, never stopping early); figures are medians of ms per decode step, plus the
median of the paired (same round) ratio current-off / baseline.
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The old lighthouse keeper climbed the spiral stairs every evening at dusk."


def baseline_package(rev: str, folder: Path) -> None:
    """`ember/` at `rev`, unpacked into folder/ember_base with its own imports renamed."""
    archive = subprocess.run(["git", "archive", rev, "ember"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "ember").rename(folder / "ember_base")
    pattern = re.compile(r"^(\s*)(from|import) ember\b", re.MULTILINE)
    for path in (folder / "ember_base").rglob("*.py"):
        path.write_text(pattern.sub(r"\1\2 ember_base", path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-rev", default="c93adaf^", help="git revision of the baseline engine")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from ember.model import load_model
    from ember.sources import resolve_model
    from ember.tracing import Tracer

    path = resolve_model(args.model).path
    with tempfile.TemporaryDirectory() as folder:
        baseline_package(args.base_rev, Path(folder))
        sys.path.insert(0, folder)
        from ember_base.model import load_model as load_baseline

        models = {"baseline": load_baseline(path, context_length=512, threads=args.threads),
                  "current": load_model(path, context_length=512, threads=args.threads)}
    ids = models["current"].tokenize(PROMPT)
    for model in models.values():
        model.generate(ids, max_new_tokens=8, stop_at_eog=False)
    variants = {
        "baseline": lambda: models["baseline"].generate(ids, max_new_tokens=args.new_tokens,
                                                        stop_at_eog=False),
        "tracing off": lambda: models["current"].generate(ids, max_new_tokens=args.new_tokens,
                                                          stop_at_eog=False),
        "tracing on": lambda: models["current"].generate(ids, max_new_tokens=args.new_tokens,
                                                         stop_at_eog=False, tracer=Tracer()),
        "tracing + layers": lambda: models["current"].generate(ids, max_new_tokens=args.new_tokens,
                                                               stop_at_eog=False, tracer=Tracer(layers=True)),
    }
    ms: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            t = run().timings
            ms[name].append(1000 * t.decode_seconds / t.decode_evaluations)
    print(f"{args.model}, {args.threads} thread(s), {args.new_tokens} tokens, "
          f"{args.rounds} interleaved rounds")
    for name, values in ms.items():
        median = statistics.median(values)
        print(f"  {name:17s} {median:7.2f} ms/token  {1000 / median:6.1f} tok/s  (min {min(values):.2f} ms)")
    ratios = [off / base for off, base in zip(ms["tracing off"], ms["baseline"], strict=True)]
    print(f"  paired ratio tracing off / baseline: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
