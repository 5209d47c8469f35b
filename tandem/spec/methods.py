"""Speculation methods: one enum for every layer.

Values equal the wire contract's `tandem.v1.SpeculationMethod`, so gRPC edges convert with
`Method(value)` / `int(method)`; `api_name` is the OpenAI-extension spelling
(`speculation.method`). tests/unit/test_draft_worker.py checks the values stay equal.
"""
from __future__ import annotations

import enum

from tandem.errors import InvalidArgument


class Method(enum.IntEnum):
    UNSPECIFIED = 0  # on the wire: "the server's default"
    NONE = 1  # plain decoding
    DRAFT_MODEL = 2  # a separate small causal LM (draft worker)
    NGRAM = 3  # prompt lookup, no model (draft worker)
    EAGLE = 4  # a feature head on the target's hidden states (draft worker)
    SUFFIX = 5  # suffix decoding over this and earlier sequences, no model (draft worker)
    MTP = 6  # the target checkpoint's own multi-token-prediction module (draft worker)
    LAYER_SKIP = 7  # the target minus a searched set of layers (in the verifier's process)
    MEDUSA = 8  # heads on the target's last hidden state proposing a tree (in the verifier)
    # Each round the best proposal by tokens per ms: suffix or ngram made in the verifier, else
    # Medusa heads, else (linked by the gateway to a draft_model / eagle worker) its drafts.
    AUTO = 9

    @property
    def needs_features(self) -> bool:
        """Whether the verifier ships the target's hidden states to this method's sessions."""
        return self in (Method.EAGLE, Method.MTP)

    @property
    def in_verifier(self) -> bool:
        """Whether the verifier drafts this method itself, inside its engine step."""
        return self is Method.MEDUSA

    @property
    def can_tree(self) -> bool:
        """Whether this method can draft a token tree (several candidates per position)."""
        return self in (Method.EAGLE, Method.MEDUSA, Method.AUTO)  # auto: its heads' trees

    @property
    def api_name(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Method:
        """The method an API name spells; InvalidArgument names the choices."""
        for method in cls:
            if method is not cls.UNSPECIFIED and method.api_name == name:
                return method
        raise InvalidArgument(f"unknown speculation method {name!r}; expected one of "
                              f"{', '.join(API_NAMES)}")

    @classmethod
    def from_wire(cls, value: int) -> Method:
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(f"unknown speculation method {value}") from None


API_NAMES = tuple(m.api_name for m in Method if m is not Method.UNSPECIFIED)
# The draft workers' model methods an auto session may take drafts from beside its own (model
# drafts: what the verifier cannot draft itself).
AUTO_DRAFT_METHODS = frozenset({Method.DRAFT_MODEL, Method.EAGLE})
# The token-history proposers auto asks each round, in the order it asks them.
HISTORY_SOURCES = (Method.SUFFIX, Method.NGRAM)
