"""Multiple-choice accuracy as an ``evaluate`` metric, loaded by path (offline): ``evaluate.load("<this folder>")``."""

import datasets
import evaluate

_DESCRIPTION = """Accuracy of multiple-choice predictions: correct / n, where correct counts the questions whose
predicted choice index equals the reference index and n is the number of questions."""

_INPUTS = """
Args:
    predictions (list of int): predicted choice indices (0 = A).
    references (list of int): correct choice indices.
Returns:
    accuracy (float): correct / n (0.0 when n is 0).
    correct (int): number of questions answered correctly.
    n (int): number of questions.
Example:
    >>> metric = evaluate.load("trl_ppomax/judging/metrics/mcq_accuracy")
    >>> metric.compute(predictions=[1, 1, 0], references=[1, 0, 0])
    {'accuracy': 0.6666666666666666, 'correct': 2, 'n': 3}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class McqAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references) -> dict:
        correct = sum(int(p == r) for p, r in zip(predictions, references, strict=True))
        n = len(references)
        return {"accuracy": correct / n if n else 0.0, "correct": correct, "n": n}
