"""The hook stages are declared once (ember/stages.py) and everything that knows them derives from it:
a new stage is one table entry (plus the family's call), and no other module lists the stages."""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ember import cli
from ember.experiments import ActiveHooks, DisabledHooks, Experiment, HooksAdapter
from ember.experiments.base import ALL_HOOKS
from ember.inspection import STAGES as RECORDER_STAGES
from ember.inspection import BoundaryRecorder
from ember.inspection.dumps import LAYER_FILE_STAGES, LOGITS_FILE_STAGES
from ember.phases import ExecutionPhase, ModelFamily
from ember.stages import BY_NAME, HEAD_STAGES, LAYER_NAMES, LAYER_STAGES, MODEL_STAGES, NAMES, STAGES, Scope
from ember.tracing import TracingHooks

PACKAGE = Path(__file__).resolve().parent.parent / "ember"
ADAPTERS = (HooksAdapter, DisabledHooks, ActiveHooks, TracingHooks, BoundaryRecorder)


def stage_choices(command: str) -> tuple[str, ...]:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    stage = next(a for a in commands.choices[command]._actions if a.dest == "stage")
    return tuple(stage.choices)


def test_the_table_is_well_formed() -> None:
    assert len(set(NAMES)) == len(NAMES)
    for stage in STAGES:
        assert stage.name.isidentifier() and stage.argument.isidentifier(), stage
        assert stage.rows in ("tokens", "1", "heads × tokens"), stage
        widths = ("hidden", "vocab", "heads × head_dim", "kv_heads × head_dim", "positions", "experts")
        assert stage.width in widths, stage
        assert stage.phases and stage.phases <= set(ExecutionPhase), stage
        assert stage.families and stage.families <= set(ModelFamily), stage
        assert stage.meaning and not stage.meaning.endswith("."), stage
    assert ALL_HOOKS[2:-1] == NAMES


@pytest.mark.parametrize("stage", STAGES, ids=NAMES)
def test_every_stage_reaches_every_consumer(stage) -> None:
    default = getattr(Experiment, stage.name)
    assert default.__doc__ == f"{stage.meaning}, `{stage.shape}`."
    assert list(inspect.signature(default).parameters) == ["self", "ctx", stage.argument]
    for adapter in ADAPTERS:
        method = adapter.__dict__[stage.name]
        assert method.__qualname__ == f"{adapter.__qualname__}.{stage.name}"
        arity = 3 if stage.scope is Scope.LAYER else 2  # self, (layer_index,) array
        assert method.__code__.co_argcount == arity and not method.__code__.co_flags & inspect.CO_VARARGS
    assert stage.name in RECORDER_STAGES
    assert stage.name in (LOGITS_FILE_STAGES if stage.width == "vocab" else LAYER_FILE_STAGES)
    for command in ("extract", "probe"):
        assert (stage.name in stage_choices(command)) == (stage.scope is Scope.LAYER)


def test_the_disabled_adapter_costs_what_a_hand_written_no_op_costs() -> None:
    def layer_stage(self, layer_index, array):
        pass

    def model_stage(self, array):
        pass

    assert DisabledHooks.__slots__ == ()
    for stage in STAGES:
        code = DisabledHooks.__dict__[stage.name].__code__
        reference = (layer_stage if stage.scope is Scope.LAYER else model_stage).__code__
        # the same bytecode as `def after_mlp(self, layer_index, mlp_output): pass`, no closure
        assert code.co_code == reference.co_code and code.co_freevars == () and code.co_consts == (None,)


def _listed_stage_names(node: ast.AST) -> list[str]:
    elements = [*node.keys, *node.values] if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return [e.value for e in elements if isinstance(e, ast.Constant) and e.value in NAMES]


def test_no_other_module_lists_the_stages_by_hand() -> None:
    """Outside ember/stages.py no literal collection names two stages, and no stage method takes the
    engine's arguments (layer_index, array): those are the adapters', made from the table. An
    experiment overriding a hook takes `(self, ctx, tensor)` and may name its own stage."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "stages.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
            listed = _listed_stage_names(node)
            if len(listed) > 1:
                found.append(f"{where} lists {listed}")
            if isinstance(node, ast.FunctionDef) and node.name in NAMES:
                parameters = [a.arg for a in node.args.args]
                if parameters[1:2] != ["ctx"]:
                    found.append(f"{where} defines {node.name}{tuple(parameters)} by hand")
    assert found == []


NEW_STAGES = """(
    Stage("after_embedding", Scope.MODEL, "embedded", "tokens", "hidden", "The token embeddings"),
    Stage("before_mlp", Scope.LAYER, "normed", "tokens", "hidden", "The MLP's normed input"),
)"""

ADD_TWO_STAGES = f'''
import ast, sys, types
import ember.phases  # light: `import ember` loads nothing of the engine

source = open({str(PACKAGE / "stages.py")!r}).read()
tree = ast.parse(source)
table = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "STAGES").value
first, second = ast.parse({NEW_STAGES!r}, mode="eval").body.elts
names = [call.args[0].value for call in table.elts]
table.elts.insert(names.index("after_mlp"), second)  # called between after_attention and after_mlp
table.elts.insert(0, first)  # before the layers
module = types.ModuleType("ember.stages")
module.__file__ = {str(PACKAGE / "stages.py")!r}
sys.modules["ember.stages"] = module
exec(compile(tree, module.__file__, "exec"), module.__dict__)
''' + '''
import numpy as np
from ember import cli
from ember.experiments import (DISABLED_HOOKS, ActivationStats, ExecutionContext, ExecutionPhase, Experiment,
                               ExperimentRunner, LayerContext, ModelContext, ModelFamily)
from ember.inspection import BoundaryRecorder
from ember.inspection.dumps import LAYER_FILE_STAGES, array_key
from ember.tracing import Tracer, TracingHooks

LAYERS, HIDDEN = 2, 4

def toy_forward(hooks, phase=ExecutionPhase.PREFILL, start=0, rows=3):
    """A family's forward pass with the two new calls in their places."""
    hidden = np.ones((rows, HIDDEN), np.float32)
    hooks.begin_evaluation(phase, start, rows)
    hooks.after_embedding(np.full((rows, HIDDEN), 2.0, np.float32))
    for i in range(LAYERS):
        hooks.before_layer(i, hidden)
        hooks.after_attention(i, hidden)
        hooks.before_mlp(i, hidden)
        hooks.after_mlp(i, hidden)
        hooks.after_layer(i, hidden)
    hooks.before_logits(np.full((1, HIDDEN), 5.0, np.float32))
    hooks.after_logits(np.zeros((1, 7), np.float32))
    return hidden

class NewStages(Experiment):
    name = "new"
    def __init__(self):
        self.seen = []
    def after_embedding(self, ctx, embedded):
        self.seen.append(("after_embedding", type(ctx), None, embedded.shape))
    def before_mlp(self, ctx, normed):
        self.seen.append(("before_mlp", type(ctx), ctx.layer_index, normed.shape))
        normed.values_mut()[0, 0] += 1.0

assert Experiment.after_embedding.__doc__ == "The token embeddings, `[tokens, hidden]`."
toy_forward(DISABLED_HOOKS)

experiment = NewStages()
runner = ExperimentRunner([experiment], ModelContext(ModelFamily.LLAMA, "toy", "llama", LAYERS, HIDDEN))
runner.on_model_loaded()
runner.before_prefill(0, 3)
tracer = Tracer(layers=True)
hidden = toy_forward(TracingHooks(runner.hooks, tracer))
assert experiment.seen == [("after_embedding", ExecutionContext, None, (3, HIDDEN)),
                           ("before_mlp", LayerContext, 0, (3, HIDDEN)),
                           ("before_mlp", LayerContext, 1, (3, HIDDEN))], experiment.seen
assert hidden[0, 0] == 3.0  # the writes reached the engine's array
names = [span["name"] for span in tracer.spans()]
assert names == ["layer 0", "layer 1", "lm_head"], names

recorder = BoundaryRecorder(stages=["after_embedding", "before_mlp"])
toy_forward(recorder)
assert [(r.stage, r.layer) for r in recorder.records] == [
    ("after_embedding", None), ("before_mlp", 0), ("before_mlp", 1)]
assert [array_key(r) for r in recorder.records] == [
    "e000.after_embedding", "e000.before_mlp.00", "e000.before_mlp.01"]
assert {"after_embedding", "before_mlp"} <= set(LAYER_FILE_STAGES)

stats = ActivationStats()
runner = ExperimentRunner([stats], ModelContext(ModelFamily.LLAMA, "toy", "llama", LAYERS, HIDDEN))
runner.on_model_loaded()
runner.before_prefill(0, 3)
toy_forward(runner.hooks)
toy_forward(runner.hooks, ExecutionPhase.DECODE, 3, 1)  # single rows: the decode batch
rows = {(r["phase"], r["hook"], r["layer"]): r for r in stats.rows()}
for phase in ("prefill", "decode"):
    assert rows[(phase, "after_embedding", None)]["mean"] == 2.0
    assert rows[(phase, "before_logits", None)]["mean"] == 5.0
    assert rows[(phase, "before_mlp", 1)]["mean"] == 1.0
assert len(rows) == 2 * (2 + 5 * LAYERS + 1)

args = cli.build_parser().parse_args(["extract", "prompts.txt", "--stage", "before_mlp"])
assert args.stage == "before_mlp"
print("ok")
'''


def test_a_new_stage_is_one_table_entry_and_the_family_s_call() -> None:
    """Two entries added to the table (nothing else changed), a toy forward pass calling them: the
    contract, both adapters, tracing, the recorder, dumps and the CLI all know them."""
    done = subprocess.run([sys.executable, "-c", ADD_TWO_STAGES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_engine_fires_every_stage_where_the_table_says(smollm2) -> None:
    """A real generation: each stage of the family fires in its phases, once per layer (layer stages)
    or once per evaluation (model stages), in the table's order, with the table's rows and width.
    (The mixture-of-experts family's `router`: tests/test_qwen3moe.py.)"""
    config = smollm2.config
    recorder = BoundaryRecorder()
    generation = smollm2.generate("The capital of France is", max_new_tokens=3, observer=recorder)
    order = ([(s.name, None) for s in MODEL_STAGES if s not in HEAD_STAGES]
             + [(s.name, i) for i in range(config.layer_count) for s in LAYER_STAGES]
             + [(s.name, None) for s in HEAD_STAGES])
    width = {"hidden": config.hidden_size, "vocab": config.vocab_size,
             "heads × head_dim": config.head_count * config.head_dim,
             "kv_heads × head_dim": config.head_count_kv * config.head_dim}
    for evaluation in range(1 + generation.timings.decode_evaluations):
        records = [r for r in recorder.records if r.evaluation == evaluation]
        phase = records[0].phase
        expected = [(name, layer) for name, layer in order
                    if phase in BY_NAME[name].phases and config.family in BY_NAME[name].families]
        assert [(r.stage, r.layer) for r in records] == expected
        for record in records:
            stage = BY_NAME[record.stage]
            T = record.token_count
            rows = {"tokens": T, "1": 1, "heads × tokens": config.head_count * T}
            columns = width.get(stage.width, record.start_position + record.token_count)  # positions
            assert record.array.shape == (rows[stage.rows], columns), (record.stage, record.array.shape)
            assert record.array.dtype == np.float32
    assert {r.phase for r in recorder.records} == set(ExecutionPhase)
    family_stages = {s.name for s in LAYER_STAGES if config.family in s.families}
    assert family_stages <= {r.stage for r in recorder.records}
    assert "router" in set(LAYER_NAMES) - family_stages  # a llama has no router
