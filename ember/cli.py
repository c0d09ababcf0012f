"""The `ember` command: everyday use and inspection surfaces, beside the Hydra front door.

    ember generate "The capital of France is" [--experiment zero_layer:layer=3] [--trace t.json]
    ember generate "The capital of France is" --dump-layers --dump-logits --dump-dir dumps/
    ember extract prompts.jsonl --layers 0,6,-1 --stage after_layer --pool last --out states.npz
    ember probe prompts.jsonl --folds 5                  # needs a label per prompt (JSONL "label")
    ember interactive                                    # chat REPL (alias: ember chat)
    ember demo
    ember benchmark --json bench.json
    ember run experiment=zero_layer layer=7              # the Hydra front door (python -m ember.run)

Experiments (`--experiment NAME[:key=value,...]`, a built-in name or a dotted class path) run only with
`generate` and `run`. v0.1 refuses them together with dumps, extraction, probes, demo, interactive and
benchmark, before loading anything, so no value's before/after-intervention meaning is ambiguous;
`--trace` may run with experiments (they see `TracingState.ENABLED`). Records go to MLflow (the same store
as `ember run`: $MLFLOW_TRACKING_URI or outputs/mlflow.db) unless `--no-mlflow`; `interactive` and `demo`
(a conversation, a showcase) record nothing.

Exit status: 0 done, 1 an experiment failed, 2 a usage or configuration mistake, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM).
"""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE, say
from ember.errors import ConfigError, EmberError

DEFAULT_MODEL = "smollm2-135m"

# Which refusal each subcommand is subject to (generate: only with --dump-layers / --dump-logits).
SUBCOMMAND_SURFACE = {"extract": "extract", "probe": "probe", "interactive": "interactive",
                      "chat": "interactive", "demo": "demo", "benchmark": "benchmark"}


# ------------------------------------------------------------------------------------ arguments


def _common(records: bool = True) -> argparse.ArgumentParser:
    """The options every model command takes; `records`: also where its MLflow run goes (`interactive`
    and `demo` record none, so they take no `--mlflow-*` option)."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("model and records" if records else "model")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="a known name (smollm2-135m, gemma3-270m) or a .gguf path (default: %(default)s)")
    group.add_argument("--context-length", type=int, default=None, help="KV cache length (default: model's)")
    group.add_argument("--threads", type=int, default=None,
                       help="engine/BLAS threads (default: the cores other processes leave free)")
    group.add_argument("--weights", choices=("quantized", "float32", "quantized-q8"), default="quantized",
                       help="keep weights in the file's encoding, or dequantize them; quantized-q8: also "
                       "round the activations of Q4_K/Q6_K/Q8_0/Q5_0 products to 8 bits as llama.cpp does "
                       "(faster, not float32-exact) (default: %(default)s)")
    group.add_argument("--experiment", action="append", default=[], metavar="NAME[:k=v,...]",
                       help="attach an experiment (generate only; refused with inspection surfaces)")
    group.add_argument("--trace", metavar="FILE", default=None,
                       help="write a Chrome trace-event JSON (Perfetto) of load, tokenize, prefill, decode")
    group.add_argument("--trace-layers", action="store_true", help="also one span per layer (with --trace)")
    if records:
        group.add_argument("--mlflow-uri", default=None, help="MLflow tracking URI (default: as `ember run`)")
        group.add_argument("--mlflow-experiment", default="ember", help="MLflow experiment name")
        group.add_argument("--no-mlflow", action="store_true", help="record nothing in MLflow")
    group.add_argument("--quiet", action="store_true", help="no progress output")
    return common


def _sampling(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    group = parser.add_argument_group("generation")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                       help="tokens to generate; 0: prefill only, no token (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=0)


def _prompt_set_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", help="prompt set: a text file (one per line) or JSONL (prompt, label)")
    parser.add_argument("--layers", default="all", help='"all" or indices, e.g. 0,6,-1 (default: all)')
    from ember.stages import LAYER_NAMES  # the layer stages, from their table

    parser.add_argument("--stage", default="after_layer", choices=LAYER_NAMES)
    parser.add_argument("--pool", default="last", choices=("last", "mean"),
                        help="last token or mean over tokens (default: last)")


class _Parser(argparse.ArgumentParser):
    """argparse with a mistake reported as one `ember:` line (not the usage block), exit status 2."""

    def error(self, message: str) -> Any:
        print(f"ember: {message} ({self.prog} --help shows the options)", file=sys.stderr, flush=True)
        self.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    common, unrecorded = _common(), _common(records=False)
    parser = _Parser(prog="ember", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", parents=[common], help="generate text (experiments, dumps, tracing)")
    gen.add_argument("prompt", help="the prompt text (used as given unless --chat)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--dump-layers", action="store_true",
                     help="dump every layer's boundary tensors of every evaluation (layers.npz)")
    gen.add_argument("--dump-logits", action="store_true",
                     help="dump the logits of every evaluation (logits.npz)")
    gen.add_argument("--dump-dir", default=None, help="where dumps go (default: outputs/dumps/<time>)")
    _sampling(gen, 32)

    ext = sub.add_parser("extract", parents=[common], help="hidden states of a prompt set, saved as .npz")
    _prompt_set_options(ext)
    ext.add_argument("--out", default=None, help="output .npz (default: outputs/states/<time>.npz)")

    probe = sub.add_parser("probe", parents=[common], help="linear probes per layer on a labelled prompt set")
    _prompt_set_options(probe)
    probe.add_argument("--folds", type=int, default=5, help="held-out folds (default: %(default)s)")
    probe.add_argument("--seed", type=int, default=0, help="fold shuffling seed")
    probe.add_argument("--l2", type=float, default=1e-2, help="L2 penalty on the probe weights")

    for name in ("interactive", "chat"):
        chat = sub.add_parser(name, parents=[unrecorded], help="chat REPL (/reset, /exit)"
                              if name == "interactive" else "same as interactive")
        chat.add_argument("--system", default=None, help="system message")
        chat.add_argument("--no-stats", action="store_true", help="no token/speed line after each reply")
        _sampling(chat, 256)

    demo = sub.add_parser("demo", parents=[unrecorded], help="a short scripted showcase of generation")
    demo.add_argument("--max-new-tokens", type=int, default=48,
                      help="tokens per reply; 0: prefill only, no token (default: %(default)s)")

    bench = sub.add_parser("benchmark", parents=[common], help="load, prefill, decode figures and peak RSS")
    bench.add_argument("--prompt-tokens", type=int, default=64,
                       help="prompt length prefilled in each repeat (default: %(default)s)")
    bench.add_argument("--new-tokens", type=int, default=32,
                       help="tokens decoded after the prompt in each repeat, ≥ 2 (default: %(default)s)")
    bench.add_argument("--repeats", type=int, default=3,
                       help="measured repeats; the figures are their medians (default: %(default)s)")
    bench.add_argument("--json", dest="json_path", default=None,
                       help="write the figures to this file as JSON (then stdout gets a short summary)")

    sub.add_parser("run", help="the Hydra front door: ember run [group=option key=value ...] (see ember.run)",
                   add_help=False)

    runs = sub.add_parser("runs", help="look after recorded runs (ember runs repair, ember runs upload)")
    actions = runs.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    upload = actions.add_parser("upload", help="upload the records kept in outputs/mlflow-outbox while the "
                                               "tracking server was away")
    repair = actions.add_parser("repair", help="upload kept records (as upload), then close as KILLED the "
                                               "RUNNING runs whose process died")
    for action in (upload, repair):
        action.add_argument("--mlflow-uri", default=None, help="tracking URI (default: as `ember run`)")
    return parser


# ------------------------------------------------------------------------------------ helpers


def experiment_specs(texts: Sequence[str]) -> list[Any]:
    """`name` or `name:key=value,key=value` (values read as YAML scalars) -> ExperimentSpec."""
    import yaml

    from ember.runconfig import ExperimentSpec

    specs = []
    for index, text in enumerate(texts):
        name, _, rest = text.partition(":")
        if not name.strip():
            raise ConfigError(f"--experiment {text!r}: give a name, e.g. zero_layer:layer=3")
        params: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"--experiment {text!r}: parameters are key=value, got {item!r}")
            try:
                params[key.strip()] = yaml.safe_load(value)
            except yaml.YAMLError:
                params[key.strip()] = value
        name = name.strip()
        dotted = "." in name
        specs.append(ExperimentSpec(index, None if dotted else name, name if dotted else None, params))
    return specs


def mlflow_settings(args: argparse.Namespace) -> Any:
    from ember.runconfig import MlflowSettings

    return MlflowSettings(args.mlflow_uri, getattr(args, "mlflow_experiment", "ember"),
                          not getattr(args, "no_mlflow", False))


def load(args: argparse.Namespace, tracer: Any = None) -> Any:
    from ember.model import load_model
    from ember.progress import Progress

    with Progress.status(f"loading {args.model}", enabled=not args.quiet):
        return load_model(args.model, context_length=args.context_length, threads=args.threads,
                          weights=args.weights, tracer=tracer)


def _sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "seed": args.seed}


def _stamp() -> str:
    import time

    return time.strftime("%Y-%m-%d/%H-%M-%S")


def _model_tags(model: Any) -> dict[str, str]:
    return {"model.name": str(model.source.name), "model.path": str(model.source.path),
            "model.architecture": str(model.config.architecture),
            "model.layer_count": str(model.config.layer_count),
            "model.context_length": str(model.context_length)}


def _tracer(args: argparse.Namespace) -> Any:
    if not getattr(args, "trace", None):
        return None
    from ember.tracing import Tracer

    return Tracer(layers=args.trace_layers)


def _finish_trace(args: argparse.Namespace, tracer: Any, log: Any) -> None:
    if tracer is None:
        return
    path = tracer.write(args.trace)
    log.log_file(path, "trace")
    say(f"ember: trace written to {path} (open in https://ui.perfetto.dev)")


# ------------------------------------------------------------------------------------ commands


def cmd_generate(args: argparse.Namespace) -> int:
    from ember.experiments import BUILTIN_EXPERIMENTS, ExperimentFailure
    from ember.inspection.records import mlflow_run
    from ember.runconfig import build_experiments
    from ember.runs.checkpoint import Checkpoints

    specs = experiment_specs(args.experiment)
    tracer = _tracer(args)
    model = load(args, tracer)
    experiments = build_experiments(specs, BUILTIN_EXPERIMENTS, model.config.layer_count)
    prompt: Any = args.prompt
    if args.chat:
        prompt = model.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    dumping = args.dump_layers or args.dump_logits
    name = "+".join(e.name for e in experiments) or ("dump" if dumping else "generate")
    options = dict(max_new_tokens=args.max_new_tokens, tracer=tracer, **_sampling_options(args))
    with mlflow_run(mlflow_settings(args), f"{name} {model.source.name}", _model_tags(model),
                    command="ember generate") as log:
        log.log_params({"prompt": args.prompt, "chat": args.chat, **options, "tracer": tracer is not None,
                        "experiments": " ".join(args.experiment), "dump_layers": args.dump_layers,
                        "dump_logits": args.dump_logits})
        if not args.chat:
            print(args.prompt, end="", flush=True)
        # The text so far goes into the run as it comes (ember.runs.checkpoint): a killed run keeps it.
        checkpoints = Checkpoints(log, model.tokenize(prompt), experiments, show=stream)
        options.update(on_text=checkpoints.on_text, on_token=checkpoints.on_token)
        status = EXIT_OK
        try:
            if dumping:
                from ember.inspection.dumps import dump_generation

                folder = Path(args.dump_dir or Path("outputs") / "dumps" / _stamp())
                result = dump_generation(model, prompt, folder, layers=args.dump_layers,
                                         logits=args.dump_logits, **options)
                generation = result.generation
                print(flush=True)
                for file in result.files:
                    log.log_file(file, "dump")
                say(f"ember: dump of {result.index['evaluations']} evaluations written to {folder}")
            else:
                try:
                    generation = model.generate(prompt, experiments=experiments, **options)
                except ExperimentFailure as failure:
                    generation, status = failure.generation, EXIT_FAILED
                    log.failed = True
                    print(flush=True)
                    say("ember: " + str(failure))
                    log.set_tags({"ember.failure": str(failure)})
                else:
                    print(flush=True)
        except KeyboardInterrupt:  # the run ends KILLED with exactly the text shown
            checkpoints.write("interrupted")
            raise
        _log_generation(log, generation)
        _finish_trace(args, tracer, log)
        if generation is not None:
            t = generation.timings
            say(f"ember: {len(generation.token_ids)} tokens, prefill {t.prefill_tokens_per_second:.1f} "
                f"tok/s, decode {t.decode_tokens_per_second:.1f} tok/s")
    return status


def stream(piece: str) -> None:
    print(piece, end="", flush=True)


def _log_generation(log: Any, generation: Any) -> None:
    if generation is None:
        return
    t = generation.timings
    log.log_metrics([("tokens.prompt", len(generation.prompt_token_ids), 0),
                     ("tokens.generated", len(generation.token_ids), 0),
                     ("prefill.tokens_per_second", t.prefill_tokens_per_second, 0),
                     ("decode.tokens_per_second", t.decode_tokens_per_second, 0)])
    from ember.runs.records import generation_record

    log.log_json(generation_record(generation), "generation.json")  # the checkpoints' names, now complete
    log.log_text(generation.text, "generation.txt")
    from ember.runs.summary import experiment_summary

    for name, result in generation.experiment_results.items():
        log.result(name, result)
        say(f"ember: {experiment_summary(name, result)}")


def _extract(args: argparse.Namespace, log: Any) -> tuple[Any, Any, Any, list[int]]:
    from ember.inspection.extraction import extract_hidden_states, read_prompt_set

    prompt_set = read_prompt_set(args.prompts)
    tracer = _tracer(args)
    model = load(args, tracer)
    states, layers = extract_hidden_states(model, prompt_set.prompts, layers=args.layers, stage=args.stage,
                                           pool=args.pool, progress=not args.quiet, tracer=tracer)
    _finish_trace(args, tracer, log)
    return model, prompt_set, states, layers


def cmd_extract(args: argparse.Namespace) -> int:
    from ember.inspection.extraction import read_prompt_set, save_states
    from ember.inspection.records import mlflow_run

    read_prompt_set(args.prompts)  # a bad file is reported before the model loads
    with mlflow_run(mlflow_settings(args), f"extract {args.model}") as log:
        model, prompt_set, states, layers = _extract(args, log)
        out = save_states(args.out or Path("outputs") / "states" / f"{_stamp()}.npz", states, layers,
                          stage=args.stage, pool=args.pool, prompt_set=prompt_set, model=model)
        log.set_tags(_model_tags(model))
        log.log_params({"prompts": args.prompts, "layers": args.layers, "stage": args.stage,
                        "pool": args.pool, "prompt_count": len(prompt_set)})
        log.log_file(out, "states")
        say(f"ember: states {list(states.shape)} (prompt, layer, hidden) written to {out}")
    return EXIT_OK


def cmd_probe(args: argparse.Namespace) -> int:
    from ember.inspection.extraction import read_prompt_set
    from ember.inspection.probes import log_probe_report, probe_layers
    from ember.inspection.records import mlflow_run

    prompt_set = read_prompt_set(args.prompts)
    if prompt_set.labels is None:
        raise ConfigError(f'{args.prompts}: probes need a label per prompt (JSONL lines with "label")')
    with mlflow_run(mlflow_settings(args), f"probe {args.model}") as log:
        model, prompt_set, states, layers = _extract(args, log)
        report = probe_layers(states, prompt_set.labels, layers, folds=args.folds, seed=args.seed, l2=args.l2)
        log.set_tags(_model_tags(model))
        log.log_params({"prompts": args.prompts, "layers": args.layers, "stage": args.stage,
                        "pool": args.pool, "folds": args.folds, "seed": args.seed, "l2": args.l2,
                        "prompt_count": len(prompt_set)})
        log_probe_report(log, report)
        print(report.table())
    return EXIT_OK


def cmd_interactive(args: argparse.Namespace) -> int:
    from ember.chat import run_repl

    tracer = _tracer(args)
    model = load(args, tracer)
    run_repl(model, system=args.system, max_new_tokens=args.max_new_tokens, stats=not args.no_stats,
             tracer=tracer, **_sampling_options(args))
    if tracer is not None:
        tracer.write(args.trace)
    return EXIT_OK


DEMO_PROMPTS = (
    ("completion", "The three primary colours are"),
    ("chat", "Write a haiku about a lighthouse."),
    ("chat", "What is 12 times 7? Answer in one sentence."),
)


def cmd_demo(args: argparse.Namespace) -> int:
    tracer = _tracer(args)
    model = load(args, tracer)
    print(f"ember demo: {model.source.name} ({model.config.architecture}, {model.config.layer_count} layers, "
          f"loaded in {model.load_seconds:.2f} s)\n")
    for kind, text in DEMO_PROMPTS:
        print(f"── {kind}: {text}")
        prompt: Any = text
        if kind == "chat":
            prompt = model.tokenizer.encode_chat([{"role": "user", "content": text}])
        else:
            print(text, end="", flush=True)
        generation = model.generate(prompt, max_new_tokens=args.max_new_tokens, tracer=tracer, on_text=stream)
        t = generation.timings
        print(f"\n   [{len(generation.token_ids)} tokens, decode {t.decode_tokens_per_second:.1f} tok/s]\n")
    if tracer is not None:
        tracer.write(args.trace)
    return EXIT_OK


def cmd_benchmark(args: argparse.Namespace) -> int:
    from ember.inspection.records import mlflow_run
    from ember.measure import benchmark

    tracer = _tracer(args)
    figures = benchmark(args.model, context_length=args.context_length, threads=args.threads,
                        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
                        progress=not args.quiet, tracer=tracer, weights=args.weights)
    text = json.dumps(figures, indent=2)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(text + "\n")
        print(benchmark_summary(figures))
        say(f"ember: figures written to {args.json_path}")
    else:
        print(text)
    with mlflow_run(mlflow_settings(args), f"benchmark {args.model}",
                    {"model.name": figures["model"]["name"], "model.path": figures["model"]["path"]}) as log:
        log.log_params({k: v for k, v in figures["settings"].items()})
        log.log_metrics([(f"benchmark.{key}", float(value), 0) for key, value in figures["results"].items()
                         if isinstance(value, int | float)])
        log.log_json(figures, "benchmark.json")
        _finish_trace(args, tracer, log)
    return EXIT_OK


def benchmark_summary(figures: dict[str, Any]) -> str:
    """The headline figures in one line (`ember benchmark --json FILE` keeps them all in the file)."""
    r, settings = figures["results"], figures["settings"]
    decode = r.get("decode_tokens_per_second")
    decode = f", decode {decode:.1f} tok/s" if decode is not None else ""
    return (f"{figures['model']['name']}: load {r['load_seconds']:.2f} s, prefill of "
            f"{settings['prompt_tokens']} tokens {r['prefill_tokens_per_second']:.1f} tok/s{decode}, "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB ({settings['threads']} threads, median of "
            f"{settings['repeats']})")


def cmd_runs(args: argparse.Namespace) -> int:
    """`ember runs upload`: the records kept in outputs/mlflow-outbox while the store was away go to it;
    `ember runs repair`: that, then every RUNNING run whose process is gone is closed as KILLED."""
    from ember.records import outbox
    from ember.records.store import mlflow_client, resolve_store
    from ember.records.tracker import repair_store, upload_outboxes

    store = resolve_store(mlflow_settings(args))
    if store.tracking_uri.startswith("sqlite:///") and not Path(store.tracking_uri[10:]).exists():
        say(f"ember: no MLflow store at {store.tracking_uri[10:]}: nothing to {args.runs_command}")
        return EXIT_OK
    client = mlflow_client(store.tracking_uri)
    uploaded = upload_outboxes(client, store.tracking_uri)
    left = outbox.pending(outbox.default_root(), store.tracking_uri)
    if left:
        say(f"ember: {len(left)} outbox(es) for {store.tracking_uri} could not be uploaded yet: "
            f"{left[0].parent}")
    elif not uploaded and args.runs_command == "upload":
        say(f"ember: no records waiting for {store.tracking_uri}")
    if args.runs_command == "upload":
        return EXIT_OK if not left else EXIT_FAILED
    repaired = repair_store(client, store.tracking_uri)
    say(f"ember: {len(repaired)} run(s) of dead processes closed as KILLED in {store.tracking_uri}"
        if repaired else f"ember: no run of a dead process in {store.tracking_uri}")
    return EXIT_OK if not left else EXIT_FAILED


COMMANDS = {"generate": cmd_generate, "extract": cmd_extract, "probe": cmd_probe,
            "interactive": cmd_interactive, "chat": cmd_interactive, "demo": cmd_demo,
            "benchmark": cmd_benchmark, "runs": cmd_runs}


# ------------------------------------------------------------------------------------ checks


def check_options(args: argparse.Namespace) -> None:
    """Every option's type and range, from the arguments alone (the same rules as `ember run`)."""
    from ember.runconfig import check_int, check_number

    def whole(name: str, minimum: int, allow_none: bool = False) -> None:
        attribute = name.replace("-", "_")
        if hasattr(args, attribute):
            check_int(f"--{name}", getattr(args, attribute), minimum=minimum, allow_none=allow_none)

    whole("context-length", 1, allow_none=True)
    whole("threads", 1, allow_none=True)
    whole("max-new-tokens", 0)  # 0: prefill only, no token
    whole("top-k", 0)
    whole("seed", 0)
    whole("folds", 2)
    whole("prompt-tokens", 1)
    whole("new-tokens", 2)
    whole("repeats", 1)
    if hasattr(args, "temperature"):
        check_number("--temperature", args.temperature, low=0.0, high=float("inf"), high_open=True)
        check_number("--top-p", args.top_p, low=0.0, high=1.0, low_open=True)
        check_number("--min-p", args.min_p, low=0.0, high=1.0, high_open=True)
    if hasattr(args, "l2"):
        check_number("--l2", args.l2, low=0.0, high=float("inf"), high_open=True)
    experiment_specs(getattr(args, "experiment", []))  # their syntax; names and parameters need the model


def check_model(args: argparse.Namespace) -> None:
    """What needs the model file's metadata (its weights are not read): the context length, the
    experiments and their parameters, layers, and the prompt against the context."""
    from ember.families import config_from_gguf
    from ember.gguf_file import GGUFFile
    from ember.sources import resolve_model

    model_file = resolve_model(args.model, progress=not args.quiet)
    gguf = GGUFFile.open(model_file.path)
    config = config_from_gguf(gguf)
    context = args.context_length or config.context_length
    if context > config.context_length:
        raise ConfigError(f"--context-length {context} is longer than {args.model}'s trained context "
                          f"({config.context_length} tokens)")
    if args.command in ("extract", "probe"):
        from ember.inspection.extraction import resolve_layers

        resolve_layers(args.layers, config.layer_count)
    if args.command != "generate":
        return
    from ember.experiments import BUILTIN_EXPERIMENTS
    from ember.runconfig import build_experiments
    from ember.tokenizer import Tokenizer

    build_experiments(experiment_specs(args.experiment), BUILTIN_EXPERIMENTS, config.layer_count)
    tokenizer = Tokenizer.from_gguf(gguf)
    if args.chat:
        prompt_tokens = len(tokenizer.encode_chat([{"role": "user", "content": args.prompt}]))
    else:
        prompt_tokens = len(tokenizer.encode(args.prompt))
    if prompt_tokens == 0:
        raise ConfigError("the prompt is empty: give at least one token")
    if prompt_tokens + args.max_new_tokens > context:
        raise ConfigError(f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {args.max_new_tokens} "
                          f"is more than the context holds ({context} tokens; --context-length sets it, up "
                          f"to {config.context_length})")


MODEL_COMMANDS = ("generate", "extract", "probe", "interactive", "chat", "demo", "benchmark")
RECORDING_COMMANDS = ("generate", "extract", "probe", "benchmark", "runs")


# ------------------------------------------------------------------------------------ entry point


def check_combination(args: argparse.Namespace) -> None:
    """The v0.1 refusals, checked from the arguments alone (nothing is loaded yet)."""
    from ember.inspection.refusal import refuse_with_experiments

    if args.command == "runs":
        return
    experiments = [spec.partition(":")[0] for spec in args.experiment]
    if args.command == "generate":
        if args.dump_layers:
            refuse_with_experiments("dump_layers", experiments)
        if args.dump_logits:
            refuse_with_experiments("dump_logits", experiments)
    elif args.command in SUBCOMMAND_SURFACE:
        refuse_with_experiments(SUBCOMMAND_SURFACE[args.command], experiments)
    if args.trace_layers and not args.trace:
        raise ConfigError("--trace-layers needs --trace FILE")


def main(argv: Sequence[str] | None = None) -> int:
    from ember.records.store import mlflow_environment

    mlflow_environment()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        from ember.run import main as run_main

        return run_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    # SIGTERM as Ctrl-C: an open run is closed as KILLED with what it has (as `ember run` does).
    from ember.errors import raise_terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        check_combination(args)
        check_options(args)
        if args.command in MODEL_COMMANDS:
            check_model(args)
        if args.command in RECORDING_COMMANDS and not getattr(args, "no_mlflow", False):
            from ember.records.store import check_reachable, resolve_store

            check_reachable(resolve_store(mlflow_settings(args)).tracking_uri)
        from ember.records.store import quiet_mlflow_logging

        quiet_mlflow_logging()
        return COMMANDS[args.command](args)
    except EmberError as error:
        say("ember: " + str(error))
        return EXIT_USAGE
    except KeyboardInterrupt as interrupt:
        say("ember: interrupted")
        from ember.errors import Terminated

        return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
