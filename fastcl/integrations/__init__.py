"""Adapters that plug fastcl's losses into other training libraries.

Each adapter is imported on its own (``import fastcl.integrations.sentence_transformers``)
so that fastcl itself never needs the libraries it adapts to.
"""
