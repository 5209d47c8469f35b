"""Grammars compiled for one tokenizer: cached by content, bounded in time and size.

llguidance bounds its own work (lexer fuel, grammar size, Earley items per step), so a
hostile schema fails fast with a message; `compile_async` also runs it off the event loop
with a deadline, so no request waits behind another's grammar.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf

from tandem.errors import InvalidArgument
from tandem.grammar.spec import GrammarSpec
from tandem.grammar.state import GrammarState


class GrammarError(InvalidArgument):
    """The grammar cannot be compiled (HTTP 400 / INVALID_ARGUMENT), with llguidance's why."""


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...] = (),
                 cache_size: int = 256, timeout_s: float = 5.0):
        # Every end-of-reply token ends a grammar's text: the tokenizer's EOS and `eos_ids`
        # (the checkpoint's generation_config ones).
        own = () if hf_tokenizer.eos_token_id is None else (hf_tokenizer.eos_token_id,)
        self.eos_ids = tuple(dict.fromkeys(own + tuple(eos_ids)))
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(self.eos_ids) or None)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._cache: OrderedDict[str, llguidance.LLMatcher | GrammarError] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it cannot compile."""
        with self._lock:
            found = self._cache.get(spec.key)
            if found is not None:
                self._cache.move_to_end(spec.key)
        if found is None:
            found = self._compile(spec)
            with self._lock:
                self._cache[spec.key] = found
                while len(self._cache) > self._size:
                    self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found.deep_copy()

    def state_now(self, spec: GrammarSpec, committed=(), matcher=None) -> GrammarState:
        """A session's grammar at `committed` tokens (InvalidArgument if they do not follow
        it), compiled here unless `matcher` is given."""
        st = GrammarState(matcher or self.matcher(spec), self.vocab_size, self.eos_ids)
        if not st.commit(list(committed)):
            raise InvalidArgument(f"committed_token_ids do not follow the {spec.kind.api_name}"
                                  f" grammar: {st.matcher.get_error()}")
        return st

    async def matcher_async(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """`matcher` on a worker thread, within the compile deadline."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.matcher, spec), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(f"{spec.kind.api_name}: compiling took longer than "
                               f"{self.timeout_s:g} s") from None

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher | GrammarError:
        what = spec.kind.api_name
        try:
            grammar = spec.llguidance()
        except (ValueError, TypeError) as exc:
            return GrammarError(f"{what}: {exc}")
        why = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if why:
            return GrammarError(f"{what}: {_first_line(why)}")
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            return GrammarError(f"{what}: {_first_line(m.get_error())}")
        return m


def _first_line(message: str, limit: int = 500) -> str:
    """llguidance's messages carry a source excerpt after the first line: keep them short."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    return text[:limit]


class LazyCompiler:
    """A GrammarCompiler built on first use (the tokenizer costs ~1 s: servers that never
    see a grammar never pay it), off the event loop."""

    def __init__(self, load: Callable[[], GrammarCompiler]):
        self._load, self._compiler = load, None
        self._lock = asyncio.Lock()

    async def get(self) -> GrammarCompiler:
        async with self._lock:
            if self._compiler is None:
                self._compiler = await asyncio.to_thread(self._load)
        return self._compiler

    def now(self) -> GrammarCompiler:
        """The compiler, once `get` has built it."""
        if self._compiler is None:
            raise RuntimeError("the grammar compiler is not built yet")
        return self._compiler

    async def state(self, spec: GrammarSpec, committed: tuple[int, ...] = ()) -> GrammarState:
        """A session's grammar at its committed tokens; GrammarError if it cannot compile,
        InvalidArgument if the committed tokens do not follow it."""
        c = await self.get()
        return c.state_now(spec, committed, await c.matcher_async(spec))


def compiler_for(root: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    """The compiler of a checkpoint directory's tokenizer."""
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(str(root)), vocab_size, eos_ids)
