"""Record ember's boundary tensors through the public experiment API (a read-only `Experiment`).

The recording has the shape of `hf_capture.Evaluation`, except that `final_norm` and `logits` hold
only the last row of each evaluation (`[1, H]`, `[1, V]`): that is all the engine computes.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember.experiments import ExecutionContext, Experiment, LayerContext, TensorAccess

from .hf_capture import Evaluation

__all__ = ["BoundaryRecorder", "record_generation"]


class BoundaryRecorder(Experiment):
    """Copies every tensor it is shown; changes nothing."""

    name = "boundary_recorder"

    def __init__(self) -> None:
        self.evaluations: list[Evaluation] = []

    def _evaluation(self, ctx: ExecutionContext) -> Evaluation:
        if not self.evaluations or self.evaluations[-1].start_position != ctx.start_position:
            self.evaluations.append(Evaluation(start_position=ctx.start_position, token_ids=[]))
        evaluation = self.evaluations[-1]
        if evaluation.final_norm is not None:
            raise AssertionError(f"two evaluations at start position {ctx.start_position}")
        return evaluation

    def _layer(self, ctx: LayerContext, boundary: str, tensor: TensorAccess) -> None:
        recorded = getattr(self._evaluation(ctx.execution), boundary)
        if len(recorded) != ctx.layer_index:
            raise AssertionError(f"{boundary} of layer {ctx.layer_index} came out of order")
        recorded.append(tensor.values().copy())

    def before_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        self._layer(ctx, "before_layer", hidden)

    def after_attention(self, ctx: LayerContext, attention_output: TensorAccess) -> None:
        self._layer(ctx, "after_attention", attention_output)

    def router(self, ctx: LayerContext, router_logits: TensorAccess) -> None:  # mixtures of experts only
        self._layer(ctx, "router", router_logits)

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        self._layer(ctx, "after_mlp", mlp_output)

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        self._layer(ctx, "after_layer", hidden)

    def before_logits(self, ctx: ExecutionContext, hidden: TensorAccess) -> None:
        self._evaluation(ctx).final_norm = hidden.values().copy()

    def after_logits(self, ctx: ExecutionContext, logits: TensorAccess) -> None:
        self.evaluations[-1].logits = logits.values().copy()


def record_generation(model, prompt_ids: Sequence[int],
                      decode_steps: int) -> tuple[list[Evaluation], list[int]]:
    """Greedy-generate with ember: a prefill then `decode_steps` decode evaluations (end-of-generation
    tokens do not stop it).

    Returns the recorded evaluations (token ids filled in) and the generated token ids.
    """
    recorder = BoundaryRecorder()
    generation = model.generate(list(prompt_ids), max_new_tokens=decode_steps + 1, temperature=0.0,
                                add_bos=False, experiments=[recorder], stop_at_eog=False)
    sequence = list(prompt_ids) + list(generation.token_ids)
    for evaluation in recorder.evaluations:
        count = evaluation.before_layer[0].shape[0] if evaluation.before_layer else 0
        evaluation.token_ids = sequence[evaluation.start_position:evaluation.start_position + count]
    if len(recorder.evaluations) != decode_steps + 1:
        raise AssertionError(f"ember ran {len(recorder.evaluations)} evaluations, "
                             f"expected {decode_steps + 1} "
                             f"(stop reason {generation.stop_reason!r})")
    return recorder.evaluations, list(generation.token_ids)
