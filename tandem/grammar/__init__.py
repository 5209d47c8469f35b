"""Structured output: grammars the generated text must follow (llguidance underneath).

spec.py names a grammar (what travels on the wire), compiler.py turns it into matchers for
one tokenizer (cached by content, bounded in time), state.py is one session's matcher with
the masks of a round's positions, masks.py applies them to the target's logits. Only spec
is imported here: the scheduler's side (pure Python) and the gateway need no torch.
"""
from tandem.grammar.spec import GrammarKind, GrammarSpec

__all__ = ["GrammarKind", "GrammarSpec"]
