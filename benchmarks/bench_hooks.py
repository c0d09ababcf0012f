"""What the experiment hooks cost: ember's prefill and decode throughput on the same model with no
experiment, with a no-op experiment implementing every hook, and with `activation_stats`.

    python -m benchmarks.bench_hooks                         # SmolLM2-135M
    python -m benchmarks.bench_hooks --repeats 9 --new-tokens 48 --json hooks.json
    python -m benchmarks.bench_hooks --model qwen3-0.6b      # a ladder shape (benchmarks/synthetic.py)

One process, one loaded model; the three configurations take turns within every repeat (rotating
which goes first) so a change in the machine's load hits them alike. Printed figures are medians over
the repeats; ratios are configuration / no experiment. Issue 4's targets: the no-op experiment costs
at most 5% of decode throughput, `activation_stats` at most 15%.

On a shared machine the end-to-end ratios carry the machine's noise, so the script also measures the
hooks alone: it replays one decode evaluation's hook calls (same shapes, same adapter) and reports
that time against the median decode step without experiments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ember
from ember.experiments import (
    DISABLED_HOOKS,
    ActivationStats,
    ExecutionPhase,
    Experiment,
    ExperimentRunner,
    TracingState,
)

try:
    from benchmarks.bench import PROMPT_TEXT
except ImportError:  # the comparison benchmark is optional here
    PROMPT_TEXT = "The old lighthouse keeper climbed the spiral stairs every evening at dusk. "

TARGET_COST = {"noop": 0.05, "activation_stats": 0.15}  # largest allowed loss of decode throughput


class NoOp(Experiment):
    """Implements every hook and does nothing: the price of the dispatch itself."""

    name = "noop"

    def on_model_loaded(self, ctx): pass
    def before_prefill(self, ctx): pass
    def before_layer(self, ctx, hidden): pass
    def after_attention(self, ctx, attention_output): pass
    def after_mlp(self, ctx, mlp_output): pass
    def after_layer(self, ctx, hidden): pass
    def before_logits(self, ctx, hidden): pass
    def after_logits(self, ctx, logits): pass
    def on_generation_complete(self, ctx): pass


CONFIGURATIONS: dict[str, Callable[[], list[Any]]] = {
    "none": lambda: [],
    "noop": lambda: [NoOp()],
    "activation_stats": lambda: [ActivationStats()],
}


def prompt_ids(model: Any, count: int) -> list[int]:
    ids = model.tokenize(PROMPT_TEXT, add_bos=False)
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def run_generation(model: Any, ids: list[int], new_tokens: int, experiments: list[Any]) -> dict[str, float]:
    generation = model.generate(ids, max_new_tokens=new_tokens, stop_at_eog=False, experiments=experiments)
    timings = generation.timings
    return {
        "prefill_tokens_per_second": timings.prefill_tokens_per_second,
        "decode_tokens_per_second": timings.decode_tokens_per_second,
    }


def replay_decode_hooks(model: Any, experiments: list[Any] | None, evaluations: int) -> float:
    """Seconds per decode evaluation spent in the hooks alone (same shapes, same adapter)."""
    config = model.config
    if experiments is None:
        hooks: Any = DISABLED_HOOKS
    else:
        runner = ExperimentRunner(experiments, model.model_context, TracingState.DISABLED)
        runner.on_model_loaded()
        runner.before_prefill(0, 1)
        hooks = runner.hooks
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, config.hidden_size)).astype(np.float32)
    attention_output = hidden.copy()
    mlp_output = hidden.copy()
    final = hidden.copy()
    logits = rng.standard_normal((1, config.vocab_size)).astype(np.float32)
    layers = range(config.layer_count)

    def evaluation(position: int) -> None:
        hooks.begin_evaluation(ExecutionPhase.DECODE, position, 1)
        for i in layers:
            hooks.before_layer(i, hidden)
            hooks.after_attention(i, attention_output)
            hooks.after_mlp(i, mlp_output)
            hooks.after_layer(i, hidden)
        hooks.before_logits(final)
        hooks.after_logits(logits)

    for position in range(10):
        evaluation(position)
    started = time.perf_counter()
    for position in range(evaluations):
        evaluation(10 + position)
    return (time.perf_counter() - started) / evaluations


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m",
                        help="model name, synthetic ladder shape or .gguf path")
    parser.add_argument("--ember-weights", choices=("quantized", "float32"),
                        help="ember.load_model(weights=...), when this ember has the option")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--replay-evaluations", type=int, default=200)
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args(argv)

    from benchmarks.bench import ember_has_weights_option
    from benchmarks.synthetic import SHAPES, ensure

    source = ensure(args.model) if args.model in SHAPES else args.model
    options = {"weights": args.ember_weights} if args.ember_weights and ember_has_weights_option() else {}
    if args.ember_weights == "quantized" and not options:
        parser.error("this ember has no weights= option (it keeps float32 weights)")
    model = ember.load_model(source, context_length=args.prompt_tokens + args.new_tokens + 8,
                             threads=args.threads, **options)
    ids = prompt_ids(model, args.prompt_tokens)
    names = list(CONFIGURATIONS)
    config = model.config
    print(f"model {model.source.name}: {config.layer_count} layers, hidden {config.hidden_size}; "
          f"prompt {len(ids)} tokens, {args.new_tokens} new tokens, {model.threads} threads, "
          f"{args.repeats} repeats")

    for name in names:  # warm-up: caches, BLAS threads, first-call costs
        run_generation(model, ids, 4, CONFIGURATIONS[name]())
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order:
            runs[name].append(run_generation(model, ids, args.new_tokens, CONFIGURATIONS[name]()))

    summary: dict[str, dict[str, float]] = {}
    for name in names:
        prefill = [run["prefill_tokens_per_second"] for run in runs[name]]
        decode = [run["decode_tokens_per_second"] for run in runs[name]]
        # Ratios are paired: each run against the no-experiment run of the same repeat.
        summary[name] = {
            "prefill_tokens_per_second": statistics.median(prefill),
            "decode_tokens_per_second": statistics.median(decode),
            "best_decode_tokens_per_second": max(decode),
            "prefill_ratio": statistics.median(
                run["prefill_tokens_per_second"] / none["prefill_tokens_per_second"]
                for run, none in zip(runs[name], runs["none"], strict=True)),
            "decode_ratio": statistics.median(
                run["decode_tokens_per_second"] / none["decode_tokens_per_second"]
                for run, none in zip(runs[name], runs["none"], strict=True)),
        }
    base = summary["none"]
    for name in names:
        summary[name]["best_decode_ratio"] = (
            summary[name]["best_decode_tokens_per_second"] / base["best_decode_tokens_per_second"])
    step_seconds = 1.0 / base["best_decode_tokens_per_second"]
    replay = {
        "none": replay_decode_hooks(model, None, args.replay_evaluations),
        "noop": replay_decode_hooks(model, [NoOp()], args.replay_evaluations),
        "activation_stats": replay_decode_hooks(model, [ActivationStats()], args.replay_evaluations),
    }

    print()
    print(f"{'experiment':<18}{'prefill tok/s':>14}{'ratio':>7}{'decode tok/s':>13}{'ratio':>7}"
          f"{'best':>8}{'ratio':>7}{'hooks µs/step':>15}{'share':>8}   target: end-to-end / hooks alone")
    verdicts = {}
    for name in names:
        row = summary[name]
        hook_share = replay[name] / step_seconds
        row.update(replay_seconds_per_step=replay[name], replay_share_of_step=hook_share)
        target = TARGET_COST.get(name)
        verdict = ""
        if target is not None:
            end_to_end_ok = 1.0 - row["decode_ratio"] <= target
            hooks_ok = hook_share <= target
            verdict = (f"   ≤{target:.0%}: {'ok' if end_to_end_ok else 'MISS'} / "
                       f"{'ok' if hooks_ok else 'MISS'}")
            verdicts[name] = {"end_to_end": end_to_end_ok, "hooks_alone": hooks_ok}
        print(f"{name:<18}{row['prefill_tokens_per_second']:>14.1f}{row['prefill_ratio']:>7.3f}"
              f"{row['decode_tokens_per_second']:>13.2f}{row['decode_ratio']:>7.3f}"
              f"{row['best_decode_tokens_per_second']:>8.2f}{row['best_decode_ratio']:>7.3f}"
              f"{replay[name] * 1e6:>15.1f}{hook_share:>8.2%}{verdict}")
    print(f"\nratios: medians of per-repeat pairs against no experiment; best: fastest repeat. "
          f"Share: hooks alone against the fastest decode step without experiments "
          f"({step_seconds * 1e3:.1f} ms).")

    report = {"args": vars(args), "model": model.source.name, "runs": runs, "summary": summary,
              "targets_met": verdicts}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
