"""The command line of `python -m ember.run` checked before Hydra runs anything, and Hydra's own errors
as one `ember:` line.

Hydra reports its errors itself (a dozen lines, exit status 1). `preflight` reads the same arguments first:
Hydra's flags with Hydra's own parser, each override with Hydra's override grammar, then the config
composed with Hydra's compose API (for a sweep, once per value of every swept key), so a mistake ends as
one line naming the key or option and what is allowed, before a sweep's parent run exists or a model is
read. `describe_hydra_error` turns any Hydra or OmegaConf exception that still gets through into such a
line.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ember.errors import ConfigError, did_you_mean
from ember.runconfig import _MLFLOW_KEYS, _MODEL_KEYS, _SAMPLING_KEYS, _TOP_LEVEL_KEYS

# Keys of ember's config whose children are known, for naming what a nested key could have been.
KNOWN_CHILDREN = {"": _TOP_LEVEL_KEYS, "model": _MODEL_KEYS, "sampling": _SAMPLING_KEYS,
                  "mlflow": _MLFLOW_KEYS}
# Hydra options that come from a plugin in ember's `cluster` extra (pyproject.toml): without it installed
# Hydra knows no such option.
CLUSTER_PLUGINS = {"hydra/sweeper=optuna": "hydra-optuna-sweeper",
                   "hydra/launcher=ray": "hydra-ray-launcher",
                   "hydra/launcher=submitit_local": "hydra-submitit-launcher",
                   "hydra/launcher=submitit_slurm": "hydra-submitit-launcher"}
QUOTING = "quote values with commas, brackets or spaces, e.g. \"prompt='Hi, there'\""


@dataclass(frozen=True, slots=True)
class CommandLine:
    overrides: tuple[str, ...]
    multirun: bool
    composes: bool  # False for --help, --hydra-help, shell completion, another primary config path
    config_dir: str | None = None  # --config-dir: a folder added to the config search path
    config_name: str | None = None  # --config-name: another primary config


class _ArgumentError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        raise _ArgumentError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def read_command_line(argv: Sequence[str]) -> CommandLine:
    """Hydra's flags and overrides; an unknown flag is a ConfigError."""
    try:
        args = _parser().parse_args(list(argv))
    except _ArgumentError as error:
        raise ConfigError(f"{error} (python -m ember.run --help shows the options)") from None
    modes = [flag for flag, given in (("--run", args.run), ("-m/--multirun", args.multirun),
                                      ("--cfg", args.cfg), ("--info", args.info),
                                      ("--shell-completion", args.shell_completion)) if given]
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)} do not go together: give one of --run, -m, --cfg, --info "
                          "(python -m ember.run --help shows the options)")
    composes = not (args.help or args.hydra_help or args.shell_completion or args.config_path
                    or args.experimental_rerun)
    return CommandLine(tuple(args.overrides), bool(args.multirun), composes, args.config_dir,
                       args.config_name)


def preflight(argv: Sequence[str], config_dir: str, config_name: str) -> set[str | None]:
    """Every Hydra-level mistake on this command line as a ConfigError, before Hydra runs. Returns the
    tracking URIs (None: the default) the jobs will record to, for a reachability check."""
    line = read_command_line(argv)
    if not line.composes:
        return set()
    parsed = parse_overrides(line.overrides)
    sweeps = [o for o in parsed if o.is_sweep_override()]
    if sweeps and not line.multirun:
        first = sweeps[0]
        raise ConfigError(
            f"{first.input_line} gives several values: add -m to run one job per value (a sweep), "
            f"write {first.get_key_element()}=[...] for a list, or {QUOTING}"
        )
    name = line.config_name or config_name
    stores: set[str | None] = set()
    for overrides in _compositions(parsed):
        stores |= compose_check(overrides, config_dir, name, line.config_dir)
    return stores


def parse_overrides(overrides: Iterable[str]) -> list[Any]:
    """Each override through Hydra's grammar, one at a time, so a bad one is named."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.extend(parser.parse_overrides([text]))
        except OverrideParseException as error:
            raise ConfigError(describe_parse_error(text, error)) from None
    return parsed


def describe_parse_error(text: str, error: BaseException) -> str:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    if "=" not in text and not text.startswith("~"):
        return f"{text!r} has no value: write {text}=VALUE"
    if "missing EQUAL" in str(error):
        return f"{text!r} has no value: write key=VALUE"
    detail = detail.replace("LexerNoViableAltException: ", "").strip()
    return f"cannot read the override {text!r} ({detail}); overrides are key=value, {QUOTING}"


def _values(override: Any) -> list[str]:
    """The values a sweep override takes, as override text (`key=value`); [] when not enumerable."""
    try:
        return [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
    except Exception:  # intervals and other non-enumerable sweeps: checked by their sweeper
        return []


def _compositions(parsed: Sequence[Any]) -> list[list[str]]:
    """Enough compositions to meet every value once: each swept value with the other swept keys at
    their first value (sum, not product, of the choices)."""
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = [(o, _values(o)) for o in parsed if o.is_sweep_override()]
    sweeps = [(o, values) for o, values in sweeps if values]
    base = fixed + [values[0] for _, values in sweeps]
    if not sweeps:
        return [fixed]
    combos = []
    for index, (_, values) in enumerate(sweeps):
        for value in values:
            combo = list(base)
            combo[len(fixed) + index] = value
            combos.append(combo)
    return combos


def compose_check(overrides: list[str], config_dir: str, config_name: str,
                  extra_dir: str | None = None) -> set[str | None]:
    """Compose the config (with Hydra's own settings) as Hydra will; its errors as a ConfigError.
    `extra_dir` is Hydra's --config-dir, searched after `config_dir`. Returns the tracking URI the job
    records to ({None} for the default, {} when it records nothing)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="ember"):
            searched = [] if extra_dir is None else [f"hydra.searchpath=[file://{os.path.abspath(extra_dir)}]"]
            cfg = compose(config_name, overrides=[*searched, *overrides], return_hydra_config=True)
            with_hydra = OmegaConf.to_container(cfg, resolve=False)
            assert isinstance(with_hydra, dict)
            with_hydra.pop("hydra", None)
            plain = OmegaConf.to_container(OmegaConf.create(with_hydra), resolve=True)  # interpolations
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(describe_hydra_error(error, overrides)) from None
    except ValueError as error:  # Hydra's own for a group given a number or a mapping: model=42
        raise ConfigError(_not_an_option(overrides, config_dir) or str(error)) from None
    mlflow = plain.get("mlflow") if isinstance(plain, dict) else None
    if not isinstance(mlflow, dict) or mlflow.get("enabled") is not True:
        return set()
    uri = mlflow.get("tracking_uri")
    return {uri if isinstance(uri, str) and uri else None}


# ------------------------------------------------------------------------------------ messages


def _not_an_option(overrides: Sequence[str], config_dir: str) -> str | None:
    """`group=42` (found by fuzzing: Hydra raises a bare ValueError) as a line naming the options."""
    from pathlib import Path

    for override in parse_overrides(overrides):
        value = override.value()
        if isinstance(value, str | list) or override.is_delete():
            continue
        group = override.key_or_group
        folder = Path(config_dir) / group
        hydras = group.startswith("hydra/")  # Hydra's own options are not all in conf/
        options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() and not hydras else []
        if options or hydras:
            allowed = f"; {group} takes one of: {', '.join(options)}" if options else ""
            return f"{override.input_line}: a config group takes an option name, not {type(value).__name__}" \
                   f" {value!r}{allowed}"
    return None


def _suggest(word: str, choices: Iterable[str]) -> str:
    return did_you_mean(word, choices)


def describe_hydra_error(error: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for a Hydra or OmegaConf error about the command line."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(error)
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options is not None:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        options = sorted(error.options)
        allowed = f"{group} takes one of: {', '.join(options)}"
        if not option:
            return f"{group}= needs an option: {allowed}"
        plugin = CLUSTER_PLUGINS.get(f"{group}={option}")
        if plugin is not None:
            return (f"{group}={option}: not installed ({plugin} comes with ember's cluster extra: "
                    f"pip install -e '.[cluster]'); {allowed}")
        return f"{group}={option}: no such option{_suggest(option, options)}; {allowed}"
    if isinstance(error, OverrideParseException):
        try:  # each override on its own: the one that fails is named
            parse_overrides(read_command_line(overrides).overrides)
        except ConfigError as named:
            return str(named)
        detail = text.splitlines()[0] if text else type(error).__name__
        return f"cannot read the overrides ({detail}); overrides are key=value, {QUOTING}"
    if text.startswith("Ambiguous value for argument"):
        argument = text.split("'", 2)[1] if "'" in text else "?"
        key = argument.split("=", 1)[0]
        return (f"{argument} gives several values: add -m to run one job per value (a sweep), "
                f"write {key}=[...] for a list, or {QUOTING}")
    cause = error.__cause__
    if text.startswith("Could not append to config"):
        key = text.split("'", 2)[1] if "'" in text else "?"
        return f"+{key}=...: {key} is already in the config; set it without the +: {key}=..."
    if text.startswith("Could not override '"):
        key = text.split("'", 2)[1] if "'" in text else "?"
        return unknown_key(getattr(cause, "full_key", None) or key)  # sampling={a:1}: sampling.a
    if text.startswith("Error merging override") and cause is not None:
        override = text[len("Error merging override "):].strip()
        reason = str(cause).splitlines()[0]
        if "index out of range" in reason:
            parts = override.split("=", 1)[0].split(".")
            at = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
            listed = ".".join(parts[:at]) or parts[0]
            hint = "pick an experiment=... option first, or " if listed == "experiments" else ""
            return f"{override}: {listed} has no item {parts[at]} ({hint}set {listed}=[...])"
        return f"{override}: {reason}"
    first = text.splitlines()[0] if text else type(error).__name__
    key = getattr(error, "full_key", None)
    if key:
        return f"{key}: {first}"
    if cause is not None and str(cause):
        first += f": {str(cause).splitlines()[0]}"
    return first


def experiment_parameters() -> set[str]:
    """Every parameter name of the built-in experiments, for suggesting what a misspelt one meant."""
    import inspect

    from ember.experiments import BUILTIN_EXPERIMENTS

    return {name for cls in BUILTIN_EXPERIMENTS.values() for name in inspect.signature(cls).parameters}


def unknown_key(key: str) -> str:
    parent, _, leaf = key.rpartition(".")
    if parent.startswith("hydra") or key.startswith("hydra"):
        return (f"unknown Hydra setting {key!r}; python -m ember.run --cfg hydra shows Hydra's settings "
                f"(add a new one with +{key}=...)")
    known = KNOWN_CHILDREN.get(parent)
    if known is None and re.fullmatch(r"experiments(\[\d+\]|\.\d+)", parent):
        return (f"unknown config key {key!r}{_suggest(leaf, experiment_parameters())}; an experiment takes "
                "its class's parameters (python -m ember.run --cfg job shows the config)")
    if known is None:
        return f"unknown config key {key!r}; python -m ember.run --cfg job shows the config"
    where = "known keys" if not parent else f"{parent} takes"
    return f"unknown config key {key!r}{_suggest(leaf, known)}; {where}: {', '.join(sorted(known))}"
