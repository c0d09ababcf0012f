"""How much an intervention changed the model: the intervened logits against one clean prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.experiments import Experiment
from ember.records.run import Record


class LogitsRecorder(Experiment):
    """Internal observer placed after the user's experiments: keeps the logits each evaluation
    produced (after every intervention), to compare with the clean model afterwards."""

    name = "ember.intervened_logits"
    may_write = False

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []

    def after_logits(self, ctx: Any, logits: Any) -> None:
        self.rows.append(np.array(logits.values()[-1], dtype=np.float32))


def _shifted(logits: np.ndarray) -> np.ndarray:
    """float64 logits minus each row's largest (exact for float32 logits)."""
    shifted = logits.astype(np.float64)
    shifted -= shifted.max(axis=-1, keepdims=True)
    return shifted


@dataclass(frozen=True, slots=True)
class InterventionEffect:
    kl: np.ndarray                 # [steps] KL(clean || intervened) of the next-token distributions
    top1_agree: np.ndarray         # [steps] bool: the greedy choices agree
    first_divergent_step: int      # -1: the greedy choices never differ

    @property
    def vacuous(self) -> bool:
        return bool(self.kl.size) and float(self.kl.max()) < 1e-6 and bool(self.top1_agree.all())

    def summary(self) -> dict[str, Any]:
        return {
            "steps": int(self.kl.size),
            "kl_mean": float(self.kl.mean()) if self.kl.size else 0.0,
            "kl_max": float(self.kl.max()) if self.kl.size else 0.0,
            "top1_agreement": float(self.top1_agree.mean()) if self.kl.size else 1.0,
            "first_divergent_step": self.first_divergent_step,
            "vacuous": self.vacuous,
            "kl": self.kl.tolist(),
            "top1_agree": self.top1_agree.astype(int).tolist(),
        }


def intervention_effect(clean: np.ndarray, intervened: np.ndarray) -> InterventionEffect:
    """Compare aligned rows of clean and intervened logits ([steps, V] each).

    KL(p || q) = sum p (log p - log q), with log p = c - log Zc and log q = i - log Zi for the shifted
    rows c, i: sum(e^c (c - i)) / Zc - log Zc + log Zi. Two exponentials over the vocabulary per step
    instead of three (the study pays this per item: 2x faster, the same values to 1e-15)."""
    c, i = _shifted(clean), _shifted(intervened)
    e = np.exp(c)
    z_clean = e.sum(axis=-1)
    z_intervened = np.exp(i).sum(axis=-1)
    c -= i
    kl = np.einsum("sv,sv->s", e, c) / z_clean - np.log(z_clean) + np.log(z_intervened)
    agree = clean.argmax(axis=-1) == intervened.argmax(axis=-1)
    differ = np.flatnonzero(~agree)
    return InterventionEffect(np.maximum(kl, 0.0), agree, int(differ[0]) if differ.size else -1)


def measure_effect(model: Any, prompt_ids: list[int], generated: list[int],
                   recorded: list[np.ndarray]) -> InterventionEffect | None:
    """One clean prefill over prompt + generated tokens; row P-1+s predicts generated token s."""
    steps = min(len(recorded), len(generated) + 1)
    if steps == 0:
        return None
    sequence = list(prompt_ids) + list(generated[: steps - 1])
    clean = model.logits(sequence)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + steps]
    return intervention_effect(clean, np.stack(recorded[:steps]))


def record_effect(recorder: Record, effect: InterventionEffect) -> None:
    s = effect.summary()
    metrics = [("effect.kl", float(v), i) for i, v in enumerate(effect.kl)]
    metrics += [("effect.top1_agree", float(v), i) for i, v in enumerate(effect.top1_agree)]
    metrics += [("effect.kl_mean", s["kl_mean"], 0), ("effect.kl_max", s["kl_max"], 0),
                ("effect.top1_agreement", s["top1_agreement"], 0),
                ("effect.first_divergent_step", s["first_divergent_step"], 0),
                # 1 when the intervention changed the answer's first token (a search's target)
                ("effect.answer_changed", 1.0 if s["first_divergent_step"] == 0 else 0.0, 0)]
    recorder.log_metrics(metrics)
    recorder.log_json(s, "intervention_effect.json")
    verdict = "none: logits equal the clean model's" if effect.vacuous else (
        "changed greedy choices" if s["first_divergent_step"] >= 0 else "changed probabilities only")
    recorder.set_tags({"ember.intervention_effect": verdict})
