"""Validation of a composed run configuration, before any model is loaded.

`parse_run_config` checks every value's type and range and turns the Hydra/OmegaConf tree into frozen
dataclasses. `check_model_fit` checks what needs the model file's metadata (family, layer range,
lengths against the context), and `build_experiments` resolves and constructs the experiments. Every
problem a user can cause ends as one `ConfigError` naming the key, the value and what would be valid.
"""

from __future__ import annotations

import importlib
import inspect
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.errors import ConfigError, ContextLengthError, did_you_mean
from ember.records.store import MlflowSettings

MISSING = "???"

_TOP_LEVEL_KEYS = {
    "model", "prompt", "messages", "max_new_tokens", "layer", "experiments", "intervention_effect",
    "threads", "sampling", "mlflow", "tracing", "trace_layers", "stop_at_eog", "data",
    "objective",  # checked by ember.runs.objective
    "senders", "receivers", "channel",  # experiment=path_patching's, passed on as ${senders} …
}
_MODEL_KEYS = {"source", "family", "context_length", "weights"}
_WEIGHT_MODES = ("quantized", "float32", "quantized-q8")
_SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "seed"}
_MLFLOW_KEYS = {"tracking_uri", "experiment_name", "enabled"}
_CHAT_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True, slots=True)
class ModelSettings:
    source: str
    family: str | None
    context_length: int | None
    weights: str = "quantized"


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int


@dataclass(frozen=True, slots=True)
class ExperimentSpec:
    """One entry of `experiments`: a built-in `name` or a `_target_` class, plus its parameters."""

    index: int
    name: str | None
    target: str | None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name if self.name is not None else str(self.target)

    @property
    def where(self) -> str:
        return f"experiments[{self.index}] ({self.label})"


@dataclass(frozen=True, slots=True)
class RunConfig:
    model: ModelSettings
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    max_new_tokens: int
    sampling: SamplingSettings
    experiments: tuple[ExperimentSpec, ...]
    intervention_effect: bool
    threads: int | None
    mlflow: MlflowSettings
    layer: int | None = None
    tracing: bool = False
    trace_layers: bool = False
    stop_at_eog: bool = True
    data: Any = None  # ember.data.DataSpec: a prompt set (a study), or None


# ---------------------------------------------------------------------------------------- values


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int(where: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be at least {minimum}, got {value}")
    return value


def _float(where: str, value: Any, *, low: float, high: float, low_open: bool = False,
           high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where} must be a number, got {_show(value)}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if not math.isfinite(number) or too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        upper = "inf" if math.isinf(high) else f"{high:g}"
        raise ConfigError(f"{where} must be in {left}{low:g}, {upper}{right}, got {value}")
    return number


# The same checks for other front doors (the `ember` command's options).
check_int = _int
check_number = _float


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {_show(value)}")
    return value


def _str(where: str, value: Any, *, allow_none: bool = False, allow_empty: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {_show(value)}")
    if not allow_empty and not value.strip():
        raise ConfigError(f"{where} must not be empty")
    return value


def _choice(where: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ConfigError(f"{where} must be one of {', '.join(allowed)}, got {_show(value)}")
    return str(value)


def _mapping(where: str, value: Any, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {_show(value)}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown key {where}.{unknown[0]}; {where} takes: {', '.join(sorted(allowed))}"
        )
    return value


def _missing_hint(key: str) -> str:
    if key == "model.source":
        return " (e.g. model=path model.source=/path/to/model.gguf)"
    return ""


# ---------------------------------------------------------------------------------------- parse


def to_plain(cfg: Any) -> dict[str, Any]:
    """A DictConfig (or mapping) as plain Python values, interpolations resolved, without `hydra`.

    A mandatory value left unset (`???`) is a ConfigError naming the key.
    """
    try:
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:  # pragma: no cover - omegaconf comes with hydra-core
        DictConfig = ()  # type: ignore[assignment]
    if DictConfig and isinstance(cfg, DictConfig):
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
        if missing:
            raise ConfigError(f"{missing[0]} has no value and needs one{_missing_hint(missing[0])}")
        try:
            plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as error:
            raise ConfigError(f"the configuration cannot be resolved: {error}".splitlines()[0]) from None
    else:
        plain = dict(cfg)
    assert isinstance(plain, dict)
    plain.pop("hydra", None)
    return plain


def parse_run_config(cfg: Any) -> RunConfig:
    """Check every value's type and range (no file is read); a ConfigError names the first problem."""
    plain = to_plain(cfg)
    unknown = sorted(set(plain) - _TOP_LEVEL_KEYS)
    if unknown:
        known = ", ".join(sorted(_TOP_LEVEL_KEYS))
        raise ConfigError(f"unknown config key {unknown[0]!r}; known keys: {known}")

    model_cfg = _mapping("model", plain.get("model"), _MODEL_KEYS)
    source = _str("model.source", model_cfg.get("source"))
    if source == MISSING:
        raise ConfigError(f"model.source has no value and needs one{_missing_hint('model.source')}")
    model = ModelSettings(
        source=str(source),
        family=_str("model.family", model_cfg.get("family"), allow_none=True),
        context_length=_int("model.context_length", model_cfg.get("context_length"), minimum=1,
                            allow_none=True),
        weights=_choice("model.weights", model_cfg.get("weights", "quantized"), _WEIGHT_MODES),
    )

    from ember.data import parse_data_spec

    data = parse_data_spec(plain.get("data"))
    prompt = _str("prompt", plain.get("prompt"), allow_none=True, allow_empty=True)
    messages = _messages(plain.get("messages"))
    if messages is None and not prompt and data is None:
        raise ConfigError('prompt is empty and no chat messages are given: set prompt="..." or messages')

    sampling_cfg = _mapping("sampling", plain.get("sampling"), _SAMPLING_KEYS)
    sampling = SamplingSettings(
        temperature=_float("sampling.temperature", sampling_cfg.get("temperature"), low=0.0, high=math.inf,
                           high_open=True),
        top_k=_int("sampling.top_k", sampling_cfg.get("top_k"), minimum=0),  # type: ignore[arg-type]
        top_p=_float("sampling.top_p", sampling_cfg.get("top_p"), low=0.0, high=1.0, low_open=True),
        min_p=_float("sampling.min_p", sampling_cfg.get("min_p"), low=0.0, high=1.0, high_open=True),
        seed=_int("sampling.seed", sampling_cfg.get("seed"), minimum=0),  # type: ignore[arg-type]
    )

    mlflow_cfg = _mapping("mlflow", plain.get("mlflow"), _MLFLOW_KEYS)
    mlflow = MlflowSettings(
        tracking_uri=_str("mlflow.tracking_uri", mlflow_cfg.get("tracking_uri"), allow_none=True),
        experiment_name=str(_str("mlflow.experiment_name", mlflow_cfg.get("experiment_name"))),
        enabled=_bool("mlflow.enabled", mlflow_cfg.get("enabled")),
    )

    return RunConfig(
        model=model,
        prompt=prompt,
        messages=messages,
        # 0: prefill only, no token generated (the one rule of every front door and Model.generate)
        max_new_tokens=_int("max_new_tokens", plain.get("max_new_tokens"), minimum=0),  # type: ignore[arg-type]
        sampling=sampling,
        experiments=_experiment_specs(plain.get("experiments")),
        intervention_effect=_bool("intervention_effect", plain.get("intervention_effect")),
        threads=_int("threads", plain.get("threads"), minimum=1, allow_none=True),
        mlflow=mlflow,
        layer=_int("layer", plain.get("layer"), allow_none=True),
        tracing=_tracing(plain),
        trace_layers=_bool("trace_layers", plain.get("trace_layers", False)),
        stop_at_eog=_bool("stop_at_eog", plain.get("stop_at_eog", True)),
        data=data,
    )


def _tracing(plain: Mapping[str, Any]) -> bool:
    tracing = _bool("tracing", plain.get("tracing", False))
    if _bool("trace_layers", plain.get("trace_layers", False)) and not tracing:
        raise ConfigError("trace_layers=true needs tracing=true")
    return tracing


def _messages(value: Any) -> tuple[dict[str, str], ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise ConfigError(f"messages must be a non-empty list of {{role, content}}, got {_show(value)}")
    out = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        item = _mapping(where, item, {"role", "content"})
        role = _str(f"{where}.role", item.get("role"))
        if role not in _CHAT_ROLES:
            raise ConfigError(f"{where}.role must be one of {', '.join(sorted(_CHAT_ROLES))}, got {role!r}")
        content = _str(f"{where}.content", item.get("content"), allow_empty=True)
        out.append({"role": str(role), "content": str(content)})
    return tuple(out)


def _experiment_specs(value: Any) -> tuple[ExperimentSpec, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"experiments must be a list, got {_show(value)}")
    specs = []
    for i, item in enumerate(value):
        where = f"experiments[{i}]"
        if isinstance(item, str):  # a bare built-in name is accepted as shorthand
            item = {"name": item}
        if not isinstance(item, Mapping):
            raise ConfigError(f"{where} must be a mapping with `name` or `_target_`, got {_show(item)}")
        params = dict(item)
        name = params.pop("name", None)
        target = params.pop("_target_", None)
        if (name is None) == (target is None):
            raise ConfigError(
                f"{where} needs exactly one of `name` (a built-in experiment) or `_target_` (a class path)"
            )
        if name is not None:
            _str(f"{where}.name", name)
        if target is not None:
            _str(f"{where}._target_", target)
            if "." not in target:
                raise ConfigError(
                    f"{where}._target_ must be a dotted path like package.module.Class, got {target!r}"
                )
        for key in params:
            if not isinstance(key, str) or not key.isidentifier():
                raise ConfigError(f"{where}: parameter name {key!r} is not a valid identifier")
        specs.append(ExperimentSpec(index=i, name=name, target=target, params=params))
    return tuple(specs)


# ---------------------------------------------------------------------------------------- model fit


def family_matches(expected: str, family: str, architecture: str) -> bool:
    """Whether the configured family names the file's family (or its architecture)."""
    wanted = expected.strip().lower()
    return wanted in {family.lower(), architecture.lower()}


def check_model_fit(
    run: RunConfig,
    *,
    path: str,
    architecture: str,
    family: str,
    layer_count: int,
    context_length: int,
    prompt_token_count: int | None = None,
) -> None:
    """What needs the file's metadata: family, layer, lengths against the context."""
    if run.model.family is not None and not family_matches(run.model.family, family, architecture):
        raise ConfigError(
            f"model.family is {run.model.family!r} but {path} is a {family} model "
            f"(architecture {architecture!r}); set model.family={family} or pick another model"
        )
    if run.layer is not None:
        check_layer("layer", run.layer, layer_count)
    if run.model.context_length is not None and run.model.context_length > context_length:
        raise ContextLengthError(
            f"model.context_length={run.model.context_length} is longer than the model's trained context "
            f"({context_length} tokens)"
        )
    context = run.model.context_length or context_length
    if context < context_length:
        room = f"model.context_length={context}; this model supports up to {context_length}"
    else:
        room = "the model's whole context"
    if run.max_new_tokens >= context:
        raise ContextLengthError(
            f"max_new_tokens={run.max_new_tokens} cannot fit: the context holds {context} tokens "
            f"including the prompt ({room})"
        )
    if prompt_token_count is not None and prompt_token_count + run.max_new_tokens > context:
        raise ContextLengthError(
            f"the prompt ({prompt_token_count} tokens) plus max_new_tokens={run.max_new_tokens} is "
            f"{prompt_token_count + run.max_new_tokens} tokens, more than the context holds "
            f"({context}: {room})"
        )


def check_layer(where: str, value: Any, layer_count: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be a layer index (an integer), got {_show(value)}")
    if not 0 <= value < layer_count:
        raise ConfigError(
            f"{where}={value} is out of range: this model has {layer_count} layers (0..{layer_count - 1})"
        )
    return value


# ---------------------------------------------------------------------------------------- experiments


def resolve_experiment_class(spec: ExperimentSpec, builtins: Mapping[str, Any]) -> type:
    """The class a spec names: a built-in by name, or a `_target_` imported from its module."""
    from ember.experiments import Experiment

    if spec.name is not None:
        from ember.experiments.registry import ALIASES, experiment_names

        name = spec.name if spec.name in builtins else ALIASES.get(spec.name, spec.name)
        if name not in builtins:
            known = [*builtins, *(alias for alias, real in ALIASES.items() if real in builtins)]
            raise ConfigError(
                f"unknown experiment {spec.name!r} in experiments[{spec.index}]"
                f"{did_you_mean(spec.name, known)}; built-in experiments: "
                f"{', '.join(experiment_names(dict(builtins)))}; or a class by its dotted path, "
                "package.module.Class"
            )
        cls = builtins[name]
    else:
        module_name, _, class_name = str(spec.target).rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ConfigError(
                f"experiments[{spec.index}]._target_={spec.target}: cannot import module {module_name!r} "
                f"({error}); run from the folder that holds it or add it to PYTHONPATH"
            ) from None
        except Exception as error:  # the researcher's module itself is broken
            raise ConfigError(
                f"experiments[{spec.index}]._target_={spec.target}: importing {module_name!r} failed: "
                f"{type(error).__name__}: {error}"
            ) from None
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ConfigError(
                f"experiments[{spec.index}]._target_={spec.target}: {module_name} has no {class_name!r}"
            )
    if not (inspect.isclass(cls) and issubclass(cls, Experiment)):
        raise ConfigError(f"{spec.where}: {cls!r} is not an ember.experiments.Experiment subclass")
    return cls


def build_experiments(
    specs: Sequence[ExperimentSpec], builtins: Mapping[str, Any], layer_count: int
) -> list[Any]:
    """Check each spec's parameters against its class and the model, then construct the experiments."""
    built = []
    for spec in specs:
        cls = resolve_experiment_class(spec, builtins)
        params = _checked_params(spec, cls, layer_count)
        try:
            experiment = cls(**params)
        except ConfigError:
            raise
        except Exception as error:
            raise ConfigError(f"{spec.where}: {describe_error(error)}") from None
        built.append(experiment)
    return built


def describe_error(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _checked_params(spec: ExperimentSpec, cls: type, layer_count: int) -> dict[str, Any]:
    signature = inspect.signature(cls)
    accepted = {
        name: p for name, p in signature.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    for key in spec.params:
        if key not in accepted and not takes_any:
            known = ", ".join(accepted) or "none"
            raise ConfigError(f"{spec.where} has no parameter {key!r}{did_you_mean(key, accepted)}; its "
                              f"parameters: {known}")
    for name, parameter in accepted.items():
        if parameter.default is inspect.Parameter.empty and name not in spec.params:
            raise ConfigError(f"{spec.where} needs parameter {name!r}{_layer_hint(name, layer_count)}")
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # annotations that cannot be evaluated are not checked
        hints = {}
    params = dict(spec.params)
    for key, value in params.items():
        where = f"{spec.where}.{key}"
        if value is None and key in ("layer", "layers") and accepted.get(key) is not None \
                and not _allows_none(hints.get(key)):
            raise ConfigError(f"{spec.where} needs a value for {key!r}{_layer_hint(key, layer_count)}")
        if key in hints and not _matches(value, hints[key]):
            raise ConfigError(f"{where} must be {_describe_type(hints[key])}, got {_show(value)}")
        if key in ("layer", "layers") and value is not None:
            if isinstance(value, Sequence) and not isinstance(value, str):
                for i, item in enumerate(value):
                    check_layer(f"{where}[{i}]", item, layer_count)
            else:
                check_layer(where, value, layer_count)
    return params


def _layer_hint(name: str, layer_count: int) -> str:
    if name in ("layer", "layers"):
        return f": add layer=N with N in 0..{layer_count - 1}"
    return ""


def _allows_none(hint: Any) -> bool:
    if hint is None:
        return True
    return type(None) in typing.get_args(hint) or hint is type(None) or hint is Any


def _matches(value: Any, hint: Any) -> bool:
    """A conservative structural check; unknown annotations always match."""
    if hint is Any or hint is None:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence, typing.Sequence):
        if isinstance(value, str) or not isinstance(value, Sequence):
            return False
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return len(args) != 1 or all(_matches(item, args[0]) for item in value)
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    return True


def _describe_type(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if hint in names:
        return names[hint]
    return str(hint).replace("typing.", "")


def settings_from_config(config: Any) -> MlflowSettings | None:
    """The `mlflow` section of a (possibly invalid) config, or None when it cannot be read."""
    from omegaconf import OmegaConf

    section = OmegaConf.select(config, "mlflow", default=None)
    if section is None:
        return None
    try:
        return MlflowSettings(
            tracking_uri=section.get("tracking_uri"),
            experiment_name=str(section.get("experiment_name") or "ember"),
            enabled=bool(section.get("enabled", True)),
        )
    except Exception:  # invalid values: each job reports them itself
        return None
