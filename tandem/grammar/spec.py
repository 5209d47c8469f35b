"""What a structured-output request constrains the text to, as it travels: a kind and its
source text. Compiled per tokenizer by tandem.grammar.compiler."""
from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import dataclass

from tandem.errors import InvalidArgument

MAX_SOURCE_CHARS = 256 * 1024  # a grammar bigger than this is not a request, it is an attack
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarKind(enum.IntEnum):
    """Values match tandem.v1.Grammar.Kind on the wire."""

    UNSPECIFIED = 0
    JSON_SCHEMA = 1  # a JSON Schema document; {"type": "object"} is OpenAI's json_object
    REGEX = 2  # a regular expression the whole text matches (Rust regex syntax)
    CHOICE = 3  # a JSON list of strings: the text is exactly one of them
    LARK = 4  # a Lark (or GBNF) context-free grammar with a `start` rule

    @property
    def api_name(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str

    def __post_init__(self):
        if not isinstance(self.kind, GrammarKind) or self.kind is GrammarKind.UNSPECIFIED:
            raise InvalidArgument(f"grammar: unknown kind {self.kind!r}")
        if not self.source:
            raise InvalidArgument(f"grammar: empty {self.kind.api_name}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidArgument(f"grammar: {self.kind.api_name} has {len(self.source)} "
                                  f"characters, more than {MAX_SOURCE_CHARS}")
        if self.kind is GrammarKind.CHOICE:
            _check_choices(self.source)

    @functools.cached_property
    def key(self) -> str:
        """Content address: equal grammars share one compilation (hashed once: a source
        may be 256 KiB, and the key is read on the event loop)."""
        h = hashlib.sha256(f"{int(self.kind)}\x00{self.source}".encode())
        return h.hexdigest()

    @classmethod
    def from_wire(cls, msg) -> GrammarSpec | None:
        """A tandem.v1.Grammar field's spec (None when unset); InvalidArgument if bad."""
        if msg is None:
            return None
        try:
            kind = GrammarKind(msg.kind)
        except ValueError:
            raise InvalidArgument(f"grammar: unknown kind {msg.kind}") from None
        return cls(kind, msg.source)

    def to_wire(self) -> dict:
        """Keyword arguments of the tandem.v1.Grammar message."""
        return {"kind": int(self.kind), "source": self.source}

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        if schema is False:
            raise InvalidArgument("grammar: the schema false admits no text")
        if schema is True:  # any JSON value, as the schema {} says
            schema = {}
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, json.dumps(list(options)))

    def llguidance(self) -> str:
        """The grammar in llguidance's own form (not yet checked: the compiler does)."""
        import llguidance  # imported here: the gateway's schemas need no Rust extension

        if self.kind is GrammarKind.CHOICE:
            # Literal alternatives, escaped: choice strings are text, not regex.
            alts = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return llguidance.grammar_from("lark", f"start: {alts}")
        if self.kind is GrammarKind.JSON_SCHEMA:
            # One spelling of each JSON text (json.dumps's separators, no free whitespace):
            # what models write, and the grammar then forces every key and separator, which
            # become free drafts (GrammarState.forced). A schema's x-guidance may override.
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_STYLE)
        fmt = {GrammarKind.REGEX: "regex", GrammarKind.LARK: "grammar"}[self.kind]
        return llguidance.grammar_from(fmt, self.source)


def _check_choices(source: str) -> None:
    try:
        options = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"grammar: choice must be a JSON list of strings: {exc}") from None
    if (not isinstance(options, list) or not options
            or not all(isinstance(o, str) and o for o in options)):
        raise InvalidArgument("grammar: choice must be a non-empty list of non-empty strings")
