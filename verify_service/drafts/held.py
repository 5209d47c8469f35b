"""Commits held back from a paused draft worker (one asked for no drafts): it learns the
tokens, and an EAGLE session's target features, with its next ask in one message, not one
per round: each message costs both processes' CPU on a shared host, and at 4 sessions an
EAGLE worker asked for nothing still took ~0.5 ms of each side per round."""
from __future__ import annotations

from tandem.spec import Commit, Features
from verify_service.session.sequence import Sequence


def _earliest(row: int | None, features: Features | None) -> int | None:
    """The first row of `row` and `features` (a recomputation may resend earlier rows)."""
    if features is None:
        return row
    return features.start_position if row is None else min(row, features.start_position)


class HeldCommits:
    def __init__(self):
        # session -> (first token held, first feature row held: None if none was)
        self._held: dict[str, tuple[int, int | None]] = {}

    def hold(self, session_id: str, start: int, features: Features | None) -> None:
        """Hold a paused session's commit of the tokens from `start` (and its features, which
        the session keeps: seq.link)."""
        held, rows = self._held.get(session_id, (start, None))
        self._held[session_id] = (held, _earliest(rows, features))

    def take(self, seq: Sequence, start: int, tokens: list[int], features: Features | None
             ) -> tuple[int, list[int], Features | None]:
        """The commit to send now: this round's, from the first token held on, with every
        feature row since the first held (this round's included)."""
        held, rows = self._held.pop(seq.session_id, (start, None))
        if rows is not None:
            features = seq.link.features_from(_earliest(rows, features))
        return held, seq.tokens[held:start] + tokens, features

    def drop(self, session_id: str) -> None:
        """Forget them: a re-attach's Open sends every token and feature."""
        self._held.pop(session_id, None)

    def final(self, seq: Sequence) -> Commit | None:
        """Before a Close: the held tokens (a worker's learner reads the final text)."""
        held = self._held.pop(seq.session_id, None)
        if held is None:
            return None
        return Commit(seq.session_id, seq.epoch, held[0], seq.tokens[held[0]:], 0, None)
