"""SentEval-protocol STS scores as a sentence-transformers evaluator.

:class:`SentEvalSTSEvaluator` plugs into ``SentenceTransformerTrainer(evaluator=...)`` (or is
called on a model directly) and reports the scores ``python -m fastcl.evaluate`` gives: the
``SentenceTransformer`` embeds both sentences of every pair with its own ``encode`` (its own
modules: pooling, Dense, Normalize ...), and :func:`fastcl.evaluate.evaluate_embeddings`
scores them (cosine, Spearman ×100, STS12–16 pooled over subsets, the average of the scores
rounded to two decimals). Data files and task names are those of :mod:`fastcl.evaluate`.
"""

from __future__ import annotations

import csv
import logging
import os

from fastcl.evaluate import DEV, check_tasks, evaluate_embeddings, load_task

try:  # sentence-transformers ≥ 6
    from sentence_transformers.base.evaluation.evaluator import BaseEvaluator as SentenceEvaluator
except ImportError:
    try:  # 5.4 to 5.x: the module of 6 under the class's former name (the old path warns there)
        from sentence_transformers.base.evaluation.evaluator import SentenceEvaluator
    except ImportError:
        try:  # before 5.4
            from sentence_transformers.evaluation import SentenceEvaluator
        except ImportError as err:  # pragma: no cover - exercised without the package only
            raise ImportError(
                "fastcl.integrations.sentence_transformers.evaluation needs the sentence-transformers "
                "package: pip install sentence-transformers (or pip install 'fastcl[dev]')") from err

logger = logging.getLogger(__name__)

__all__ = ["SentEvalSTSEvaluator"]


class SentEvalSTSEvaluator(SentenceEvaluator):
    """Spearman ×100 of cosine similarities on STS tasks, as SentEval scores them for SimCSE.

    Args:
        sts_dir: the data folder (layout in :mod:`fastcl.evaluate`).
        tasks: task names (default the dev tasks ``stsb-dev`` and ``sickr-dev``; the test
            tasks ``sts12 ... sts16 stsb sickr`` work too). Every task's file is read here,
            once: a missing or malformed file is an error now, not a silently skipped task
            during training.
        name: prefix of the metric names (``""``: none).
        batch_size: sentences per ``model.encode`` batch.
        show_progress_bar: ``model.encode``'s progress bar.
        metrics: also report alignment and uniformity per task (Wang & Isola; alignment over
            the pairs with gold score ≥ 4).
        write_csv: append the scores to ``<output_path>/senteval_sts_results[_<name>].csv``
            when the trainer gives an output path.
        max_seq_length: the model's input limit while it is evaluated (None: the model's
            own); a trainer that cuts training inputs shorter evaluates at full length.

    Calling it returns ``{f"{name}_{task}": score, ..., f"{name}_avg": average}`` (plus
    ``{name}_{task}_alignment`` / ``_uniformity`` with ``metrics=True``). The primary metric
    is ``{name}_avg`` with several tasks, else the single task's score; greater is better.
    A score that is NaN (constant or non-finite embeddings) is reported as NaN, with a
    warning naming the reason.
    """

    def __init__(self, sts_dir, tasks=DEV, *, name: str = "senteval", batch_size: int = 64,
                 show_progress_bar: bool = False, metrics: bool = False, write_csv: bool = True,
                 max_seq_length: int | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sts_dir = sts_dir
        self.tasks = check_tasks(tasks)
        self.data = {task: load_task(sts_dir, task) for task in self.tasks}
        self.name = name
        self.batch_size = batch_size
        self.show_progress_bar = show_progress_bar
        self.metrics = metrics
        self.write_csv = write_csv
        self.max_seq_length = max_seq_length
        self.greater_is_better = True
        self.primary_metric = "avg" if len(self.tasks) > 1 else self.tasks[0]
        self.csv_file = "senteval_sts_results" + (f"_{name}" if name else "") + ".csv"

    def embed(self, model, sentences):
        """The model's embeddings of ``sentences`` (N×d, float32 numpy)."""
        limit = model.max_seq_length
        if self.max_seq_length is not None:
            model.max_seq_length = self.max_seq_length
        try:
            return model.encode(sentences, batch_size=self.batch_size,
                                show_progress_bar=self.show_progress_bar, convert_to_numpy=True)
        finally:
            model.max_seq_length = limit

    def __call__(self, model, output_path: str | None = None, epoch: int = -1,
                 steps: int = -1) -> dict:
        where = "" if epoch == -1 else (f" after epoch {epoch}" if steps == -1
                                        else f" in epoch {epoch} after {steps} steps")
        logger.info(f"SentEvalSTSEvaluator: {', '.join(self.tasks)}{where}")
        result = evaluate_embeddings(lambda task, sentences: self.embed(model, sentences),
                                     self.sts_dir, self.tasks, metrics=self.metrics, data=self.data)
        for task, why in result["undefined"].items():
            logger.warning(f"SentEvalSTSEvaluator: {task} has no correlation (NaN): {why}")
        scores = {**result["scores"], "avg": result["avg"]}
        out = dict(scores)
        for task, values in result["metrics"].items():
            out.update({f"{task}_{k}": v for k, v in values.items() if v is not None})
        logger.info("SentEvalSTSEvaluator: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items()))
        if output_path is not None and self.write_csv:
            self._append_csv(output_path, epoch, steps, scores)
        metrics = self.prefix_name_to_metrics(out, self.name)
        self.store_metrics_in_model_card_data(model, metrics, epoch, steps)
        return metrics

    def _append_csv(self, output_path, epoch, steps, scores: dict) -> None:
        os.makedirs(output_path, exist_ok=True)
        path = os.path.join(output_path, self.csv_file)
        new = not os.path.isfile(path)
        with open(path, "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["epoch", "steps", *scores])
            writer.writerow([epoch, steps, *scores.values()])

    @property
    def description(self) -> str:
        return "SentEval STS"

    def get_config_dict(self) -> dict:
        return {"tasks": list(self.tasks)}
