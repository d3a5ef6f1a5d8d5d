"""The former home of :class:`SentEvalSTSEvaluator`, which lives in
:mod:`fastcl.integrations.sentence_transformers.evaluation`; this path keeps working."""

from fastcl.integrations.sentence_transformers.evaluation import SentEvalSTSEvaluator

__all__ = ["SentEvalSTSEvaluator"]
