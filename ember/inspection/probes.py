"""Linear probes per layer: multinomial logistic regression in NumPy, scored on held-out folds.

For each layer, `folds` stratified splits (every class spread evenly over the folds, shuffled with
`seed`): the probe is fitted on the other folds (features standardised with the training folds' mean and
deviation, L2 penalty `l2` on the weights, full-batch gradient descent with step 1/L where L bounds the
loss's curvature) and scored on the held-out fold. The report gives, per layer, the mean held-out
accuracy, its spread over folds, and the mean training accuracy; chance is the largest class share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def fit_logistic(x: np.ndarray, y: np.ndarray, classes: int, *, l2: float = 1e-2,
                 iterations: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Weights [H, C] and bias [C] of a softmax regression on standardised features x [N, H] (float64)."""
    n, h = x.shape
    onehot = np.zeros((n, classes))
    onehot[np.arange(n), y] = 1.0
    # Curvature bound of the mean cross-entropy: ½·σ_max([x 1])² / n, plus the penalty.
    augmented = np.hstack([x, np.ones((n, 1))])
    step = 1.0 / (0.5 * np.linalg.norm(augmented, 2) ** 2 / n + l2)
    weights = np.zeros((h, classes))
    bias = np.zeros(classes)
    for _ in range(iterations):
        scores = x @ weights + bias
        scores -= scores.max(axis=1, keepdims=True)
        probabilities = np.exp(scores)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        error = (probabilities - onehot) / n
        weights -= step * (x.T @ error + l2 * weights)
        bias -= step * error.sum(axis=0)
    return weights, bias


def stratified_folds(y: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Fold number of each sample: each class is shuffled and dealt round-robin over the folds."""
    rng = np.random.default_rng(seed)
    assignment = np.empty(len(y), np.int64)
    offset = 0
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        assignment[members] = (np.arange(len(members)) + offset) % folds
        offset += len(members)
    return assignment


@dataclass(slots=True)
class ProbeReport:
    layers: list[int]
    classes: list[str]
    test_accuracy: np.ndarray   # [layers] mean over folds
    test_accuracy_std: np.ndarray
    train_accuracy: np.ndarray
    folds: int
    chance: float
    samples: int

    def rows(self) -> list[dict[str, Any]]:
        return [{"layer": layer, "test_accuracy": float(self.test_accuracy[i]),
                 "test_accuracy_std": float(self.test_accuracy_std[i]),
                 "train_accuracy": float(self.train_accuracy[i]), "folds": self.folds}
                for i, layer in enumerate(self.layers)]

    def table(self) -> str:
        lines = [f"linear probe, {self.samples} prompts, classes {', '.join(self.classes)}, "
                 f"{self.folds}-fold held-out accuracy (chance {self.chance:.2f})",
                 "layer  test_acc  ±std   train_acc"]
        for row in self.rows():
            lines.append(f"{row['layer']:>5}  {row['test_accuracy']:8.3f}  {row['test_accuracy_std']:5.3f}"
                         f"  {row['train_accuracy']:9.3f}")
        return "\n".join(lines)

    def figure(self) -> Figure:
        from matplotlib.figure import Figure

        figure = Figure(figsize=(7, 4), layout="constrained")
        ax = figure.subplots()
        ax.errorbar(self.layers, self.test_accuracy, yerr=self.test_accuracy_std, marker="o",
                    capsize=3, label="held-out")
        ax.plot(self.layers, self.train_accuracy, marker=".", linestyle="--", label="train")
        ax.axhline(self.chance, color="grey", linewidth=1, label="chance")
        ax.set_xlabel("layer")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"linear probe accuracy by layer ({self.folds}-fold)")
        ax.legend()
        return figure


def probe_layers(states: np.ndarray, labels: Sequence[str], layers: Sequence[int], *, folds: int = 5,
                 seed: int = 0, l2: float = 1e-2, iterations: int = 300) -> ProbeReport:
    """Probe each layer of states [N, L, H] for `labels` (one per prompt)."""
    if len(labels) != states.shape[0]:
        raise ConfigError(f"{len(labels)} labels for {states.shape[0]} prompts: give one label per prompt")
    classes, y = np.unique(np.asarray(labels), return_inverse=True)
    if len(classes) < 2:
        raise ConfigError("probes need at least two different labels")
    smallest = int(np.bincount(y).min())
    if folds < 2 or smallest < folds:
        raise ConfigError(f"{folds}-fold probes need folds ≥ 2 and at least {folds} prompts of every label; "
                          f"the smallest class has {smallest}")
    fold_of = stratified_folds(y, folds, seed)
    test = np.zeros((len(layers), folds))
    train = np.zeros((len(layers), folds))
    for li in range(len(layers)):
        features = states[:, li].astype(np.float64)
        for fold in range(folds):
            held_out = fold_of == fold
            x_train, x_test = features[~held_out], features[held_out]
            mean, std = x_train.mean(axis=0), x_train.std(axis=0)
            std[std == 0] = 1.0
            x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
            weights, bias = fit_logistic(x_train, y[~held_out], len(classes), l2=l2, iterations=iterations)
            train[li, fold] = np.mean((x_train @ weights + bias).argmax(axis=1) == y[~held_out])
            test[li, fold] = np.mean((x_test @ weights + bias).argmax(axis=1) == y[held_out])
    return ProbeReport(list(layers), [str(c) for c in classes], test.mean(axis=1), test.std(axis=1),
                       train.mean(axis=1), folds, float(np.bincount(y).max() / len(y)), len(y))


def log_probe_report(log: Any, report: ProbeReport, prefix: str = "probe") -> None:
    """Metrics per layer (step = layer), the table as JSON/CSV/text and the accuracy plot."""
    from ember.records.values import table_csv

    rows = report.rows()
    log.log_metrics([(f"{prefix}.test_accuracy", r["test_accuracy"], r["layer"]) for r in rows]
                    + [(f"{prefix}.train_accuracy", r["train_accuracy"], r["layer"]) for r in rows]
                    + [(f"{prefix}.best_test_accuracy", float(report.test_accuracy.max()), 0),
                       (f"{prefix}.chance", report.chance, 0)])
    log.log_json(rows, f"{prefix}/accuracy_by_layer.json")
    log.log_text(table_csv(rows), f"{prefix}/accuracy_by_layer.csv")
    log.log_text(report.table() + "\n", f"{prefix}/accuracy_by_layer.txt")
    if log.recording:
        log.log_figure(report.figure(), f"{prefix}/accuracy_by_layer.png")
