"""`path_patching`: how much of the logit difference flows from chosen sender heads along one path: to
the logits directly, or into chosen receiver heads' queries, keys or values (Wang et al. 2022, the IOI
paper; the convention of ARENA's IOI exercises, built on TransformerLens).

Per item (pairs as `head_patching` takes them: a clean prompt, a corrupted prompt of the same token
count, an answer and a wrong answer), with every head's output the `attention_heads` stage (the output
projection's input):

1. the clean run and the corrupted run, each head's output recorded at every layer;
2. the clean prompt again, the senders' outputs taken from the corrupted run and *every other head's
   output frozen* to its clean value at every layer (the MLPs, norms and everything else recomputed,
   as in the paper and ARENA's `patch_or_freeze_head_vectors`). A change at a sender then reaches a
   later point only through the residual stream and the MLPs, not through other heads;
   * `receivers=logits`: the score is read from this run's logits (the final norm recomputed, ARENA's
     `get_path_patch_head_to_final_resid_post`): the sender → logits path, its direct effect;
   * receiver heads: their inputs in this run are recorded, channel `q` (`attention_queries`), `k`
     (`attention_keys`) or `v` (`attention_values`), as attention reads them (after QK-norm and rope);
3. (receiver heads) the clean prompt once more, only the receivers' chosen channel replaced by the
   values recorded in 2, nothing frozen (ARENA's `patch_head_input`); the score is read from its logits.

Score (ARENA's): the change of the logit difference over the clean–corrupted gap,

    (LD_patched − LD_clean) / (LD_clean − LD_corrupted),   LD = logit(answer) − logit(wrong answer)

0: the path carries nothing; −1: the path alone turns the clean behaviour into the corrupted one.
Every position is patched (the heads' outputs before the first changed token are the same in both runs,
so the patches take effect from it on).

A sender can reach a receiver only from an earlier layer: senders whose layers are all at or after
every receiver's layer score exactly 0 and are not run (ARENA's loop stops before the receivers' last
layer likewise).

Grouped-query attention: keys and values belong to a KV head read by several query heads. A receiver's
`k` or `v` means its own (TransformerLens' `ungroup_grouped_query_attention`): run 3 writes the KV head's
keys or values, and the other query heads reading that KV head ("bystanders", not receivers themselves)
get back the output they have without the write. At the first receiver layer that is the clean run's
output. At a later receiver layer with bystanders it depends on the receivers below, so run 3 becomes a
chain: a run patched below that layer and not at it gives the bystanders' outputs, then a run reusing it
from that layer on patches there and puts them back (one more run per such layer).

Modes: `senders` a list of heads `[[layer, head], ...]` patched together (one score per item), or `all`:
every head as a sender of its own (a layers × heads map of scores).

Batched with prefix reuse: runs 2 and 3 start from the clean run's saved state at the first changed
position and at the first layer they change (run 2: the first sender's or receiver's layer; run 3: the
first receiver's layer, each later run of a chain its predecessor from the layer it changes), all
senders' runs of an item (and several items') in one batch.

Results: per item the clean, corrupted and (fixed senders) patched logit differences and the `score`;
with `senders=all` the lowest score per layer (`score.min`, a series), the mean layers × heads map
(figure and array `mean_score`), tables `senders` (every head's mean, standard error, n) and
`top_senders`, and the first `figure_items` items' own maps.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ember import stages
from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.patching import (
    answer_pair,
    changed_positions,
    check_pairs,
    logit_difference,
    score_maps,
)
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, ItemResult, StudyItem

if TYPE_CHECKING:
    from ember.svg_figure import SvgFigure

CHANNELS = dict(zip("qkv", stages.ATTENTION_INPUTS, strict=True))  # channel → the stage it patches
SCORE_LABEL = "(LD patched − LD clean) / (LD clean − LD corrupted)"
TOP_SENDERS = 10

Head = tuple[int, int]


class PathPatching(Experiment):
    """Path patching from sender heads to the logits or to receiver heads' q, k or v (module docstring).

    Parameters: `senders` (`[[layer, head], ...]` patched together, or `all`: each head alone),
    `receivers` (`logits`, or `[[layer, head], ...]` with `channel` q, k or v), `figure_items` (items
    with their own map when `senders=all`, default 1), `name`.
    """

    may_write = True
    batched = True  # contract v0.3: its hooks read each sequence's rows by `ctx.spans`

    def __init__(self, senders: str | Sequence[Sequence[int]] = "all",
                 receivers: str | Sequence[Sequence[int]] = "logits", channel: str | None = None,
                 figure_items: int = 1, name: str = "path_patching") -> None:
        self.name = name
        self.sweep = senders == "all"
        self.senders: tuple[Head, ...] = () if self.sweep else _heads(senders, "senders", "all")
        self.receivers: tuple[Head, ...] = () if receivers == "logits" else _heads(receivers, "receivers",
                                                                                  "logits")
        if self.receivers:
            if channel is None:
                raise ConfigError("path_patching: channel is missing; receiver heads need channel q, k or v")
            if channel not in CHANNELS:
                raise ConfigError(f"path_patching: channel must be q, k or v, got {channel!r}")
            # listen only at the receivers' channel (the engine forms that stage only for listeners)
            setattr(self, CHANNELS[channel], self._receiver_inputs)
        elif channel is not None:
            raise ConfigError(f"path_patching: channel {channel!r} is for receiver heads; with "
                              f"receivers=logits leave it out (null)")
        if isinstance(figure_items, bool) or not isinstance(figure_items, int) or figure_items < 0:
            raise ConfigError(f"path_patching: figure_items must be a count (0 or more), "
                              f"got {figure_items!r}")
        self.channel = channel
        self.figure_items = figure_items
        self._layer_count = 0
        self._head_count = 0
        self._head_dim = 0
        self._kv_width = 0
        self._model = ""
        self._groups: list[tuple[Head, ...]] = []
        self._recorded: dict[tuple[str, int, int], np.ndarray] = {}  # (run, item, layer) → heads
        self._sent: dict[tuple[int, int, int], np.ndarray] = {}      # (item, group, layer) → receiver inputs
        self._held: dict[tuple[int, int, int], np.ndarray] = {}      # (item, group, link) → bystanders' heads
        self._chain: list[int] = []  # the layers run 3's links start at (module docstring)
        self._scores: list[np.ndarray] = []                         # per item [groups]
        self._maps: list[tuple[int, np.ndarray]] = []
        self._passes = 0

    # -- the model ---------------------------------------------------------------------------------

    def check_model(self, ctx: ModelContext) -> None:
        """Refuse heads the model does not have (the runner asks before loading it)."""
        if not ctx.head_count:
            raise ConfigError("path_patching: the model context does not say how many heads a layer has")
        for what, heads in (("senders", self.senders), ("receivers", self.receivers)):
            for layer, head in heads:
                if not (0 <= layer < ctx.layer_count and 0 <= head < ctx.head_count):
                    raise ConfigError(f"path_patching: {what} [{layer}, {head}] is not a head of this model "
                                      f"(layers 0..{ctx.layer_count - 1}, heads 0..{ctx.head_count - 1})")

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self.check_model(ctx)
        self._layer_count, self._head_count = ctx.layer_count, ctx.head_count
        self._model = ctx.model_id or ctx.architecture
        every = [((layer, head),) for layer in range(ctx.layer_count) for head in range(ctx.head_count)]
        self._groups = every if self.sweep else [self.senders]

    # -- hooks -------------------------------------------------------------------------------------

    def attention_heads(self, ctx: LayerContext, heads: TensorAccess) -> None:
        """Record the clean and corrupted runs' heads; in run 2 freeze every head to its clean output but
        the senders' (the corrupted run's); in run 3 give the bystanders of a patched KV head the output
        they have without the write (the clean run's, or held from the chain's previous run)."""
        if ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        layer = ctx.layer_index
        for span in ctx.spans:
            tag = span.tag
            if tag is None:
                continue
            if tag[0] in ("clean", "corrupted"):
                self._recorded[(tag[0], tag[1], layer)] = heads.values()[span.rows].copy()
                self._head_dim = heads.shape[1] // self._head_count
            elif tag[0] == "send":  # ("send", item, group)
                values = heads.values_mut()
                values[span.rows] = self._recorded[("clean", tag[1], layer)][span.start_position:]
                corrupted = self._recorded[("corrupted", tag[1], layer)][span.start_position:]
                for sender_layer, head in self._groups[tag[2]]:
                    if sender_layer == layer:
                        columns = self._columns(head)
                        values[span.rows, columns] = corrupted[:, columns]
            elif tag[0] == "receive" and self.channel in ("k", "v"):  # ("receive", item, group, link)
                item, group, link = tag[1:]
                if link + 1 < len(self._chain) and layer == self._chain[link + 1]:  # not patched here
                    self._held[(item, group, link)] = heads.values()[span.rows].copy()
                elif layer == self._chain[link] and self._bystanders(layer):
                    held = (self._recorded[("clean", item, layer)][span.start_position:] if link == 0
                            else self._held.pop((item, group, link - 1)))
                    values = heads.values_mut()
                    for head in self._bystanders(layer):
                        columns = self._columns(head)
                        values[span.rows, columns] = held[:, columns]

    def _receiver_inputs(self, ctx: LayerContext, tensor: TensorAccess) -> None:
        """The receivers' channel (bound as `attention_queries`, `_keys` or `_values`): recorded in run 2,
        written in run 3."""
        if ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        layer = ctx.layer_index
        for span in ctx.spans:
            tag = span.tag
            if tag is None:
                continue
            if tag[0] == "clean":
                self._kv_width = tensor.shape[1]
            elif tag[0] in ("send", "receive") and any(lr == layer for lr, _ in self.receivers):
                columns = self._channel_columns(layer)
                if tag[0] == "send":
                    self._sent[(tag[1], tag[2], layer)] = tensor.values()[span.rows][:, columns].copy()
                elif tag[3] + 1 == len(self._chain) or layer < self._chain[tag[3] + 1]:  # its link's layers
                    tensor.values_mut()[span.rows, columns] = self._sent[(tag[1], tag[2], layer)]

    def _columns(self, head: int) -> slice:
        return slice(head * self._head_dim, (head + 1) * self._head_dim)

    def _per_kv_head(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return self._head_count // (self._kv_width // self._head_dim)

    def _channel_columns(self, layer: int) -> np.ndarray:
        """The columns of layer `layer`'s receivers in their channel's tensor (k, v: their KV heads')."""
        heads = sorted({h if self.channel == "q" else h // self._per_kv_head()
                        for lr, h in self.receivers if lr == layer})
        return np.concatenate([np.arange(h * self._head_dim, (h + 1) * self._head_dim) for h in heads])

    def _bystanders(self, layer: int) -> list[int]:
        """The query heads of layer `layer` that read a receiver's KV head and are not receivers."""
        receivers = {h for lr, h in self.receivers if lr == layer}
        group = self._per_kv_head()
        shared = {h // group for h in receivers}
        return [h for h in range(self._head_count) if h // group in shared and h not in receivers]

    # -- a study item ------------------------------------------------------------------------------

    def check_items(self, items: Sequence[StudyItem]) -> None:
        check_pairs(items, self.name)

    def evaluate_item(self, item: StudyItem) -> Generator[Any, Any, ItemResult]:
        assert item.corrupted_ids is not None
        index = item.index
        pair = answer_pair(item)  # the two logits each run is read at
        clean, corrupted = yield [
            Evaluation(item.token_ids, tag=("clean", index), save="clean", logit_ids=pair),
            Evaluation(item.corrupted_ids, tag=("corrupted", index), logit_ids=pair)]
        ld_clean, ld_corrupted = logit_difference(clean), logit_difference(corrupted)
        layers = sorted({layer for layer, _ in self.receivers})
        self._chain = layers[:1] + [layer for layer in layers[1:]
                                    if self.channel in ("k", "v") and self._bystanders(layer)]
        start = int(changed_positions(item)[0])
        receiver_layers = [layer for layer, _ in self.receivers]
        last = max(receiver_layers) if receiver_layers else self._layer_count
        run = [g for g, group in enumerate(self._groups) if min(layer for layer, _ in group) < last]
        first = {g: min(layer for layer, _ in self._groups[g] + self.receivers) for g in run}
        patched: list[np.ndarray] = []
        if run:  # (every step asks for something)
            patched = yield [Evaluation(item.token_ids, tag=("send", index, g), reuse="clean", start=start,
                                        first_layer=first[g], logit_ids=pair) for g in run]
        for link, layer in enumerate(self._chain if run else ()):
            more = link + 1 < len(self._chain)
            patched = yield [Evaluation(item.token_ids, tag=("receive", index, g, link), start=start,
                                        reuse=("link", g, link - 1) if link else "clean", first_layer=layer,
                                        save=("link", g, link) if more else None, logit_ids=pair)
                             for g in run]
        self._passes += len(run) * (1 + len(self._chain))
        gap = ld_clean - ld_corrupted
        scores = np.zeros(len(self._groups))
        lds = np.full(len(self._groups), ld_clean)
        for g, logits in zip(run, patched, strict=True):
            lds[g] = logit_difference(logits)
            scores[g] = (lds[g] - ld_clean) / gap if abs(gap) > 1e-6 else math.nan
        for key in [key for key in self._recorded if key[1] == index]:
            del self._recorded[key]
        for store in (self._sent, self._held):
            for key in [key for key in store if key[0] == index]:
                del store[key]
        self._scores.append(scores)
        result = ItemResult(values={"logit_diff_clean": ld_clean, "logit_diff_corrupted": ld_corrupted})
        if not self.sweep:
            result.values.update(logit_diff_patched=float(lds[0]), score=float(scores[0]))
            result.key = ("score",)
            return result
        grid = scores.reshape(self._layer_count, self._head_count)
        if len(self._maps) < self.figure_items:
            self._maps.append((index, grid))
        result.values["score.min"] = float(np.nanmin(grid)) if np.isfinite(grid).any() else math.nan
        result.series["score.min"] = {layer: float(np.nanmin(row)) if np.isfinite(row).any() else math.nan
                                      for layer, row in enumerate(grid)}
        result.key = ("score.min",)
        return result

    # -- results -----------------------------------------------------------------------------------

    def results(self) -> ExperimentResult:
        metrics = [Metric("items", float(len(self._scores))), Metric("patch_passes", float(self._passes))]
        if not self._scores:
            return ExperimentResult(metrics=metrics)
        stacked = np.stack(self._scores)  # [items, groups]
        finite = np.isfinite(stacked)
        n = finite.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(finite, stacked, 0.0).sum(axis=0) / n
            sem = np.sqrt((np.where(finite, stacked - mean, 0.0) ** 2).sum(axis=0) / (n - 1) / n)
        metrics.append(Metric("mean_score" if not self.sweep else "mean_score.min",
                              float(mean[0] if not self.sweep else np.nanmin(mean))))
        if not self.sweep:
            return ExperimentResult(metrics=metrics, arrays={"scores": stacked})
        rows = [{"layer": layer, "head": head, "mean_score": _plain(mean[g]), "sem": _plain(sem[g]),
                 "n": int(n[g])} for g, ((layer, head),) in enumerate(self._groups)]
        ranked = sorted((r for r in rows if r["mean_score"] is not None), key=lambda r: -abs(r["mean_score"]))
        top = [{"rank": rank, **r} for rank, r in enumerate(ranked[:TOP_SENDERS], 1)]
        grid = mean.reshape(self._layer_count, self._head_count)
        items, model = len(self._scores), self._model
        builders: dict[str, Any] = {"mean_score": lambda: self._figure(
            grid, f"{self._title()}, mean over n = {items} items" + (f" ({model})" if model else ""))}
        arrays = {"mean_score": grid}
        for index, scores in self._maps:
            arrays[f"item{index}_score"] = scores
            builders[f"item{index}_score"] = lambda s=scores, i=index: self._figure(
                s, f"{self._title()}, item {i}" + (f" ({model})" if model else ""))
        return ExperimentResult(metrics=metrics, tables={"senders": rows, "top_senders": top}, arrays=arrays,
                                figure_builders=builders)

    def _title(self) -> str:
        if not self.receivers:
            return "path patching, every sender head → logits"
        heads = ", ".join(f"{layer}.{head}" for layer, head in self.receivers)
        return f"path patching, every sender head → {heads} ({self.channel})"

    def _figure(self, scores: np.ndarray, title: str) -> SvgFigure:
        return score_maps([("senders", scores)], list(range(self._layer_count)),
                          [str(h) for h in range(self._head_count)], title, xlabel="head", label=SCORE_LABEL)


def _heads(value: Any, what: str, word: str) -> tuple[Head, ...]:
    """Distinct (layer, head) pairs, sorted, from `[[layer, head], ...]` (ConfigError naming `what`)."""
    usage = f"path_patching: {what} must be {word} or a list of [layer, head] pairs"
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ConfigError(f"{usage}, got {value!r}")
    pairs = []
    for pair in value:
        if (isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)):
            raise ConfigError(f"{usage}, got {list(value)!r}")
        pairs.append((int(pair[0]), int(pair[1])))
    return tuple(sorted(set(pairs)))


def _plain(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
