"""A draft with another tokenizer: the map between its vocabulary and the target's, and the
re-encoding of a session's text into the draft's ids.

Two token ids correspond when the tokens decode to the same bytes (vLLM's heterogeneous
vocabularies and transformers' UAG-TLI map the same way). Each tokenizer's vocabulary strings
are normalised to bytes by its own decoder (byte-level BPE's byte alphabet; SentencePiece's
'▁' and <0xNN> byte fallback). The map is one-to-one: where several ids of one side decode to
the same bytes, only one of them is kept (a plain token before a byte-fallback one, then the
lowest id), so a draft distribution restricted to the mapped ids carries over to target ids
unchanged. Special tokens are never mapped: a special token's meaning is its role, not its
text, and a reply's end is then always the target's own token.
"""
from __future__ import annotations

import json
import re
from collections.abc import Hashable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class BridgeError(ValueError):
    """The two tokenizers cannot be bridged (a decoder this module does not read)."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:  # bytes without a printable form are shifted past 255, in order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoders(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    return spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]


def _piece_reader(decoder: dict | None):
    """A function: one vocabulary string -> the bytes it decodes to (None: it cannot)."""
    steps = _decoders(decoder)
    kinds = {d.get("type") for d in steps}
    if "ByteLevel" in kinds:
        table = _byte_decoder()
        return lambda s: bytes(table[c] for c in s) if all(c in table for c in s) else None
    unknown = kinds - {"Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
    if unknown:
        raise BridgeError(f"cannot read tokens decoded by {sorted(unknown)}")
    swaps = [(d["pattern"]["String"], d["content"]) for d in steps
             if d.get("type") == "Replace" and "String" in d.get("pattern", {})]
    swaps += [(d.get("replacement", "▁"), " ") for d in steps if d.get("type") == "Metaspace"]
    fallback = "ByteFallback" in kinds

    def read(s: str) -> bytes | None:
        m = _BYTE_FALLBACK.match(s) if fallback else None
        if m:
            return bytes([int(m.group(1), 16)])
        for old, new in swaps:  # Strip only trims a whole text's ends: not per token
            s = s.replace(old, new)
        return s.encode("utf-8")
    return read


def token_bytes(tokenizer_json: dict, vocab_size: int) -> list[bytes | None]:
    """Per id in [0, vocab_size): the bytes that token decodes to; None for special tokens
    and ids the tokenizer does not define."""
    out: list[bytes | None] = [None] * vocab_size
    read = _piece_reader(tokenizer_json.get("decoder"))
    for i, piece in _pieces(tokenizer_json).items():
        if 0 <= i < vocab_size:
            out[i] = read(piece)
    for added in tokenizer_json.get("added_tokens", []):
        i = added["id"]
        if 0 <= i < vocab_size:  # an added token's content is its literal text
            out[i] = None if added.get("special") else added["content"].encode("utf-8")
    return out


def _by_bytes(table: list[bytes | None], pieces: dict[int, str]) -> dict[bytes, int]:
    """bytes -> the one id kept for them: a plain token before a byte-fallback one, then the
    lowest id."""
    best: dict[bytes, int] = {}
    for i, b in enumerate(table):
        if not b:
            continue
        j = best.get(b)
        if j is None or (_is_fallback(pieces.get(j)) and not _is_fallback(pieces.get(i))):
            best[b] = i
    return best


def _is_fallback(piece: str | None) -> bool:
    return piece is not None and _BYTE_FALLBACK.match(piece) is not None


@dataclass(frozen=True)
class VocabMap:
    """The one-to-one map between the draft's and the target's ids of equal bytes."""

    draft_to_target: torch.Tensor  # [draft_vocab] int64, -1 = no target token
    target_to_draft: torch.Tensor  # [target_vocab] int64, -1 = no draft token

    def __post_init__(self) -> None:
        d2t, t2d = self.draft_to_target, self.target_to_draft
        if d2t.dim() != 1 or t2d.dim() != 1 or d2t.dtype != torch.int64 or (
                t2d.dtype != torch.int64):
            raise ValueError("the maps must be 1-D int64 tensors")
        mapped = d2t >= 0
        if (len(d2t) and int(d2t.max()) >= len(t2d)) or not torch.equal(
                t2d[d2t[mapped]], torch.nonzero(mapped).flatten()):
            raise ValueError("draft_to_target and target_to_draft are not inverse maps")

    @property
    def size(self) -> int:
        """Tokens in both vocabularies (what the draft may propose)."""
        return int((self.draft_to_target >= 0).sum())

    @property
    def draft_ids(self) -> torch.Tensor:  # [size] int64, ascending
        return torch.nonzero(self.draft_to_target >= 0).flatten()

    @classmethod
    def between(cls, draft_json: dict, draft_vocab: int, target_json: dict,
                target_vocab: int) -> VocabMap:
        """From two parsed tokenizer.json files and their models' vocabulary sizes."""
        draft = _by_bytes(token_bytes(draft_json, draft_vocab), _pieces(draft_json))
        target = _by_bytes(token_bytes(target_json, target_vocab), _pieces(target_json))
        d2t = torch.full((draft_vocab,), -1, dtype=torch.int64)
        t2d = torch.full((target_vocab,), -1, dtype=torch.int64)
        for b, d in draft.items():
            t = target.get(b)
            if t is not None:
                d2t[d], t2d[t] = t, d
        return cls(d2t, t2d)

    @classmethod
    def from_dirs(cls, draft_root: Path, draft_vocab: int, target_root: Path,
                  target_vocab: int) -> VocabMap:
        return cls.between(_read(draft_root), draft_vocab, _read(target_root), target_vocab)


def _pieces(tokenizer_json: dict) -> dict[int, str]:
    """id -> vocabulary string (BPE / WordLevel: a dict; Unigram: a list of [piece, score])."""
    vocab = tokenizer_json["model"]["vocab"]
    if isinstance(vocab, list):
        return {i: entry[0] for i, entry in enumerate(vocab)}
    return {i: s for s, i in vocab.items()}


def _read(root: Path) -> dict:
    return json.loads((Path(root) / "tokenizer.json").read_text(encoding="utf-8"))


class TextBridge:
    """Re-encodes each session's committed target ids as draft ids, through their text.

    Only committed tokens are re-encoded: the drafts a session has outstanding were sampled
    by the draft as draft ids, so they map back one to one and the draft's run-ahead continues
    its own tokens. Each session's last encoding is kept until its committed tokens change.
    """

    def __init__(self, vocab: VocabMap, draft_root: Path, target_root: Path):
        from tokenizers import Tokenizer

        self.vocab = vocab
        self._draft = Tokenizer.from_file(str(Path(draft_root) / "tokenizer.json"))
        self._target = Tokenizer.from_file(str(Path(target_root) / "tokenizer.json"))
        self._t2d = vocab.target_to_draft.tolist()
        # the draft's first token when the text is empty (a prompt of special tokens only)
        self._start = _start_id(_read(draft_root))
        self._sessions: dict[Hashable, tuple[list[int], list[int]]] = {}

    def draft_ids(self, session_key: Hashable, token_ids: list[int],
                  num_committed: int) -> tuple[list[int], int]:
        """(the draft's ids for token_ids, how many of them encode committed tokens)."""
        committed = token_ids[:num_committed]
        held = self._sessions.get(session_key)
        if held is not None and held[0] == committed:
            encoded = held[1]
        else:
            encoded = self.encode(committed)
            self._sessions[session_key] = (committed, encoded)
        drafts = [self._t2d[t] for t in token_ids[num_committed:]]
        if min(drafts, default=0) < 0:  # not this bridge's drafts: encode them as text
            return self.encode(token_ids), len(encoded)
        return encoded + drafts, len(encoded)

    def encode(self, target_ids: list[int]) -> list[int]:
        """The draft's ids for the text of target_ids (special tokens dropped)."""
        text = self._target.decode(target_ids, skip_special_tokens=True)
        ids = self._draft.encode(text, add_special_tokens=False).ids
        return ids or [self._start]

    def release(self, session_key: Hashable) -> None:
        self._sessions.pop(session_key, None)


def _start_id(tokenizer_json: dict) -> int:
    """The draft tokenizer's first special token (its BOS or end-of-text), else id 0."""
    special = [a["id"] for a in tokenizer_json.get("added_tokens", []) if a.get("special")]
    return min(special, default=0)
