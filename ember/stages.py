"""The hook stages, declared once: where in a forward pass the engine shows an activation.

Each family's forward pass calls the hooks adapter by a stage's name at that boundary: a layer stage
as `hooks.<name>(layer_index, array)` once per layer, a model stage as `hooks.<name>(array)` once per
evaluation. Everything else that knows the stages reads this table: the contract's `Experiment`
(a no-op default per stage), the adapters (`DisabledHooks`, `ActiveHooks`, `HooksAdapter`), tracing's
spans (`TracingHooks`), the boundary recorder, dumps and the CLI's `--stage` choices. They build their
per-stage methods once, when their class is created (`define_stage_methods`), so a call costs what a
hand-written method costs.

Adding a stage is one entry here (in call order) plus the family's call at that place.

This module sits below both the engine and the hook contract, like `ember.phases`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ember.phases import ExecutionPhase, ModelFamily

BOTH_PHASES = frozenset(ExecutionPhase)
EVERY_FAMILY = frozenset(ModelFamily)
# The families with mixture-of-experts models. Every qwen3moe file has experts; gemma4's dense files (E2B,
# E4B, 31B) and its MoE one (26B-A4B) are one family, told apart by `expert_count`. So a stage of these
# families marked `experts_only` fires in a model that has experts (config.expert_count > 0) and in no
# other: `layer_names(family, experts=...)`.
MIXTURE_OF_EXPERTS = frozenset({ModelFamily.QWEN3MOE, ModelFamily.GEMMA4, ModelFamily.GPT_OSS})


class Scope(Enum):
    LAYER = "layer"  # once per layer: hooks.<name>(layer_index, array); experiments get a LayerContext
    MODEL = "model"  # once per evaluation: hooks.<name>(array); experiments get an ExecutionContext


@dataclass(frozen=True, slots=True)
class Stage:
    """One boundary: its name (the hook's), scope, the array's argument name, its rows and columns
    (`tokens`: one row per evaluated token, `1`: the last token's; `hidden`, `vocab`, `experts` … wide),
    the phases it fires in and the families whose forward passes have it (tests/test_stages.py holds the
    engine to them), and what it is. Every stage is writable through `TensorAccess.values_mut()`.
    `on_demand`: showing it costs the engine something (a copy, a computation, a call), so the engine
    forms it only when the hooks listen there (`listened`). `experts_only`: the families' models with
    mixture-of-experts layers have it, their dense ones do not (`MIXTURE_OF_EXPERTS`)."""

    name: str
    scope: Scope
    argument: str
    rows: str
    width: str
    meaning: str
    phases: frozenset[ExecutionPhase] = BOTH_PHASES
    on_demand: bool = False
    families: frozenset[ModelFamily] = EVERY_FAMILY
    experts_only: bool = False

    @property
    def shape(self) -> str:
        return f"[{self.rows}, {self.width}]"


# In the order an evaluation calls them.
STAGES: tuple[Stage, ...] = (
    Stage("before_layer", Scope.LAYER, "hidden", "tokens", "hidden",
          "The residual stream entering layer `ctx.layer_index`"),
    Stage("attention_queries", Scope.LAYER, "queries", "tokens", "heads × head_dim",
          "The queries as attention reads them (after QK-norm and rope), head h in columns h·head_dim…",
          on_demand=True),
    Stage("attention_keys", Scope.LAYER, "keys", "tokens", "kv_heads × head_dim",
          "The evaluated rows' keys as attention reads them (after QK-norm and rope), KV head j in "
          "columns j·head_dim…; query head h reads KV head h // (heads / kv_heads)", on_demand=True),
    Stage("attention_values", Scope.LAYER, "values", "tokens", "kv_heads × head_dim",
          "The evaluated rows' values as attention reads them, KV head j in columns j·head_dim…",
          on_demand=True),
    Stage("attention_pattern", Scope.LAYER, "pattern", "heads × tokens", "positions",
          "The attention probabilities, row h·T + t: head h's query at the t-th evaluated row, column p: "
          "the key at position p of its sequence; writing it sets the weights each head's output is "
          "formed with", on_demand=True),
    Stage("attention_heads", Scope.LAYER, "heads", "tokens", "heads × head_dim",
          "Each head's attention output before the output projection, head h in columns h·head_dim…"),
    Stage("after_attention", Scope.LAYER, "attention_output", "tokens", "hidden",
          "The attention block's contribution to the residual, before it is added"),
    Stage("router", Scope.LAYER, "router_logits", "tokens", "experts",
          "A mixture-of-experts layer's router logits (x W_gate_inpᵀ, x the router's input: the MLP's normed "
          "input in qwen3moe, Gemma 4's own scaled norm of the residual; gpt-oss adds the router's bias), "
          "expert e in column e, before the softmax over the experts and the top-k choice (gpt-oss: the "
          "top k, then the softmax over those k, the same choice and weights); what it holds when the "
          "hook returns is what the choice and the weights are made from (−inf bans an expert, a large "
          "value forces it)", on_demand=True, families=MIXTURE_OF_EXPERTS, experts_only=True),
    Stage("after_mlp", Scope.LAYER, "mlp_output", "tokens", "hidden",
          "The MLP block's contribution to the residual, before it is added"),
    Stage("after_layer", Scope.LAYER, "hidden", "tokens", "hidden",
          "The residual stream leaving the layer"),
    Stage("before_logits", Scope.MODEL, "hidden", "1", "hidden",
          "The last token's hidden state after the final norm"),
    Stage("after_logits", Scope.MODEL, "logits", "1", "vocab",
          "The last token's logits after the family's post-processing"),
)

NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)
BY_NAME: dict[str, Stage] = {stage.name: stage for stage in STAGES}
LAYER_STAGES: tuple[Stage, ...] = tuple(stage for stage in STAGES if stage.scope is Scope.LAYER)
MODEL_STAGES: tuple[Stage, ...] = tuple(stage for stage in STAGES if stage.scope is Scope.MODEL)
LAYER_NAMES: tuple[str, ...] = tuple(stage.name for stage in LAYER_STAGES)
MODEL_NAMES: tuple[str, ...] = tuple(stage.name for stage in MODEL_STAGES)
# The model stages called after the last layer's: the LM head's (tracing times them as one span).
HEAD_STAGES: tuple[Stage, ...] = tuple(
    stage for stage in MODEL_STAGES if STAGES.index(stage) > STAGES.index(LAYER_STAGES[-1]))


def layer_names(family: ModelFamily, *, experts: bool = False) -> tuple[str, ...]:
    """The names of the layer stages `family`'s forward pass has, in call order; `experts`: in a model
    with mixture-of-experts layers (`config.expert_count` > 0), which adds the `experts_only` stages."""
    return tuple(stage.name for stage in LAYER_STAGES
                 if family in stage.families and (experts or not stage.experts_only))


def model_layer_names(config: Any) -> tuple[str, ...]:
    """`layer_names` of a loaded model's config."""
    return layer_names(config.family, experts=getattr(config, "expert_count", 0) > 0)


ON_DEMAND: frozenset[str] = frozenset(stage.name for stage in STAGES if stage.on_demand)
# The queries, keys and values as attention reads them, in that order (path patching's q, k, v channels).
ATTENTION_INPUTS: tuple[str, ...] = ("attention_queries", "attention_keys", "attention_values")


def listened(hooks: Any) -> frozenset[str]:
    """Of the on-demand stages, those at which `hooks` has listeners: what a hooks adapter says in its
    `listening` attribute (a set of stage names), every one for an adapter that does not say. A family
    reads it once per evaluation; an empty set costs it nothing."""
    return ON_DEMAND & getattr(hooks, "listening", ON_DEMAND)


def define_stage_methods(cls: type, make: Callable[[Stage], Callable[..., None]]) -> type:
    """Give `cls` one method per stage, `make(stage)`, named after the stage; returns `cls`.

    `make` is called once per stage here, never per hook call: the methods are plain functions.
    """
    for stage in STAGES:
        method = make(stage)
        method.__name__ = stage.name
        method.__qualname__ = f"{cls.__qualname__}.{stage.name}"
        # The stage's name in tracebacks and profiles too (they read the code object, shared per scope).
        method.__code__ = method.__code__.replace(co_name=stage.name, co_qualname=method.__qualname__)
        method.__module__ = cls.__module__
        setattr(cls, stage.name, method)
    return cls
