"""`ablation`: replace a layer's attention output, MLP output or both (its whole contribution to the
residual stream) with zeros or with their mean over the prompt set; or single attention heads (`heads`:
[layer, head] pairs), by replacing their columns of the layer's per-head outputs (`attention_heads`,
before the output projection) the same way.

Zero ablation is `zero_layer_output`'s intervention. Mean ablation first runs the prompt set once
(clean, `prepare_study`, the items in batches) and averages each ablated output over the items and
positions; the first position has a mean of its own (it is where models park attention, with outsized
activations; with a BOS token it is the same token in every item). Then, during every item's
generation, each ablated output is replaced by its mean, in prefill and decode.
Replacing both outputs by their means replaces the layer's whole contribution by its mean contribution.
A head's output is replaced before the output projection, so where nothing but that linear map follows
(llama, qwen3) a zeroed head takes exactly its contribution out of the attention output, and its mean
puts in its mean contribution; Gemma's post-attention norm then rescales the whole output.

The hooks handle batches (contract v0.3, `batched = True`): every sequence of a batch (`ctx.spans`) is
averaged, and ablated, exactly as it would be alone.

The runner measures the intervention per item against the clean model (KL divergence, top-1 agreement,
first divergent step, and with an answer the change in its probability and logit difference).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import LayerContext, ModelContext, TensorAccess
from ember.experiments.failure import ExperimentError
from ember.experiments.parameters import parse_phases
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, StudyItem

TARGETS = ("attention", "mlp", "both")
MODES = ("zero", "mean")
# Items per batch of the mean pass: a larger set is several batches, so that the logits handed back (one
# [vocab] row per item) stay small. The size matters little: on SmolLM2 (48 capital prompts of ~5 tokens,
# 1 thread, a loaded 2-core machine) batches of 8, 16 and 48 items took 4-9 s for the 48 with no clear
# trend, the engine's rate per row hardly growing past a few dozen rows (ember.quant.matrix.SMALL_BATCH).
ITEMS_PER_BATCH = 64


class Ablation(Experiment):
    """Zero- or mean-ablate the attention and/or MLP output of the chosen layers, or chosen heads.

    Parameters: `layer` (an index or a list), `target` (attention, mlp, both), `heads` ([layer, head]
    pairs; with or instead of `layer`), `mode` (zero, mean), `phases` (prefill, decode, both), `name`.
    """

    may_write = True
    batched = True

    def __init__(self, layer: int | Sequence[int] | None = None, target: str = "both", mode: str = "zero",
                 phases: str | Iterable[str] = "both", name: str = "ablation",
                 heads: Sequence[Sequence[int]] | None = None) -> None:
        if target not in TARGETS:
            raise ConfigError(f"ablation: target {target!r} is not one of {', '.join(TARGETS)}")
        if mode not in MODES:
            raise ConfigError(f"ablation: mode {mode!r} is not one of {', '.join(MODES)}")
        if layer is None and not heads:
            raise ConfigError("ablation needs `layer` (whose attention/MLP output to ablate) or `heads` "
                              "([layer, head] pairs), e.g. layer=7 or 'experiments.0.heads=[[7,0],[7,3]]'")
        layers = [] if layer is None else [layer] if isinstance(layer, int) else list(layer)
        if (layer is not None and not layers) or any(isinstance(x, bool) or not isinstance(x, int)
                                                     for x in layers):
            raise ConfigError(f"ablation: layer must be a layer index or a list of them, got {layer!r}")
        self.name = name
        self.layers = tuple(sorted(set(layers)))
        self._layer_set = frozenset(layers)
        self.heads = _head_pairs(heads or ())  # layer -> its ablated heads
        self._head_count = 0
        self.target = target
        self.mode = mode
        self.phases = parse_phases(phases)
        self.sites = tuple(s for s in ("attention", "mlp") if target in (s, "both"))
        self._collecting = False
        self._sums: dict[tuple[str, int], np.ndarray] = {}   # site, layer -> [2, hidden]: first / later rows
        self._counts: dict[tuple[str, int], np.ndarray] = {}
        self._means: dict[tuple[str, int], np.ndarray] = {}
        self._ablated = 0

    def on_model_loaded(self, ctx: ModelContext) -> None:
        outside = sorted(x for x in (*self.layers, *self.heads) if not 0 <= x < ctx.layer_count)
        if outside:
            raise ExperimentError(f"layer {', '.join(map(str, outside))} is outside the model: valid layers "
                                  f"are 0..{ctx.layer_count - 1}")
        if self.heads:
            self._head_count = ctx.readout.head_count if ctx.readout is not None else 0
            if not self._head_count:
                raise ExperimentError("head ablation needs the model's head count, which this engine does "
                                      "not offer (ModelContext.readout)")
            bad = sorted(h for chosen in self.heads.values() for h in chosen if not 0 <= h < self._head_count)
            if bad:
                raise ExperimentError(f"head {', '.join(map(str, bad))} is outside the model: valid heads "
                                      f"are 0..{self._head_count - 1}")

    def prepare_study(self, items: Sequence[StudyItem]
                      ) -> Generator[list[Evaluation], list[np.ndarray], None]:
        """Mean mode: one clean pass per item (ITEMS_PER_BATCH items a batch), averaging the outputs to
        ablate."""
        if self.mode != "mean":
            return
        self._collecting = True
        try:
            for first in range(0, len(items), ITEMS_PER_BATCH):
                yield [Evaluation(item.token_ids) for item in items[first:first + ITEMS_PER_BATCH]]
        finally:
            self._collecting = False
        for key, sums in self._sums.items():
            counts = self._counts[key]
            first = sums[0] / counts[0] if counts[0] else sums[1] / max(counts[1], 1)
            later = sums[1] / counts[1] if counts[1] else first
            self._means[key] = np.stack([first, later]).astype(np.float32)

    def _site(self, site: str, ctx: LayerContext, tensor: TensorAccess) -> None:
        if site == "heads":
            if ctx.layer_index not in self.heads:
                return
        elif site not in self.sites or ctx.layer_index not in self._layer_set:
            return
        if self._collecting:
            self._collect((site, ctx.layer_index), ctx, tensor.values())
            return
        if ctx.execution.phase not in self.phases:
            return
        spans = ctx.spans
        self._ablated += len(spans)  # one per sequence, batched or not
        columns = self._columns(site, ctx.layer_index, tensor.shape[1])
        if self.mode == "zero":
            tensor.values_mut()[:, columns] = 0.0
            return
        mean = self._means.get((site, ctx.layer_index))
        if mean is None:
            raise ExperimentError("mean ablation needs the prompt set's means: run it in a study (data=...)")
        values = tensor.values_mut()
        for span in spans:
            rows = values[span.rows]
            if span.start_position == 0:
                rows[0, columns] = mean[0, columns]
                rows[1:, columns] = mean[1, columns]
            else:
                rows[:, columns] = mean[1, columns]

    def _columns(self, site: str, layer: int, width: int) -> slice | np.ndarray:
        """The columns to replace: every one, or (heads) the chosen heads' of the per-head outputs."""
        if site != "heads":
            return slice(None)
        head_dim = width // self._head_count
        return np.concatenate([np.arange(h * head_dim, (h + 1) * head_dim) for h in self.heads[layer]])

    def _collect(self, key: tuple[str, int], ctx: LayerContext, values: np.ndarray) -> None:
        """Add every sequence's rows to the sums: its first position's apart (when evaluated here)."""
        if key not in self._sums:
            self._sums[key] = np.zeros((2, values.shape[1]))
            self._counts[key] = np.zeros(2)
        first = np.zeros(values.shape[0], dtype=bool)
        first[[span.rows.start for span in ctx.spans if span.start_position == 0]] = True
        self._sums[key][0] += values[first].sum(axis=0, dtype=np.float64)
        self._counts[key][0] += first.sum()
        self._sums[key][1] += values[~first].sum(axis=0, dtype=np.float64)
        self._counts[key][1] += (~first).sum()

    def attention_heads(self, ctx: LayerContext, heads: TensorAccess) -> None:
        self._site("heads", ctx, heads)

    def after_attention(self, ctx: LayerContext, attention_output: TensorAccess) -> None:
        self._site("attention", ctx, attention_output)

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        self._site("mlp", ctx, mlp_output)

    def results(self) -> ExperimentResult:
        rows = [{"site": site, "layer": layer, "first_position_norm": float(np.linalg.norm(mean[0])),
                 "mean_norm": float(np.linalg.norm(mean[1])),
                 "rows_averaged": int(self._counts[(site, layer)].sum())}
                for (site, layer), mean in sorted(self._means.items())]
        return ExperimentResult(metrics=[Metric("ablated_tensors", float(self._ablated))],
                                tables={"means": rows} if rows else {})



def _head_pairs(pairs: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """{layer: its heads} from [layer, head] pairs, each pair checked."""
    heads: dict[int, set[int]] = {}
    for pair in pairs:
        values = list(pair) if isinstance(pair, Sequence) and not isinstance(pair, str) else []
        if len(values) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in values):
            raise ConfigError(f"ablation: heads must be [layer, head] pairs of integers, got {pair!r}")
        heads.setdefault(values[0], set()).add(values[1])
    return {layer: tuple(sorted(chosen)) for layer, chosen in sorted(heads.items())}
