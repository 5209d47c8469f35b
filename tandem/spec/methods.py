"""Speculation method names (the API's) and their wire enum: one mapping for every service."""
from __future__ import annotations

from tandem.v1 import common_pb2

METHOD_TO_PB = {"none": common_pb2.SPECULATION_METHOD_NONE,
                "draft_model": common_pb2.SPECULATION_METHOD_DRAFT_MODEL,
                "ngram": common_pb2.SPECULATION_METHOD_NGRAM}
PB_TO_METHOD = {pb: name for name, pb in METHOD_TO_PB.items()}
