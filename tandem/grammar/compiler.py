"""Grammars compiled for one tokenizer: cached by content, bounded in time and size.

llguidance bounds its own work (lexer fuel, grammar size, Earley items per step), so a
hostile schema fails fast with a message; `matcher_async` also runs it off the event loop,
on threads of its own, with a deadline, so no request waits behind another's grammar.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf

from tandem.background import background_pool
from tandem.errors import InvalidArgument
from tandem.grammar.spec import GrammarSpec
from tandem.grammar.state import GrammarFailed, GrammarState, short_reason


class GrammarError(InvalidArgument):
    """The grammar cannot be compiled (HTTP 400 / INVALID_ARGUMENT), with llguidance's why."""


class GrammarCompiler:
    """Compiled grammars by content. Bounded three ways: at most `cache_size` grammars whose
    sources total at most `cache_bytes` (a compiled matcher keeps 250-550 times its source: a
    64 KB schema, +17 MB; 512 KiB of source, at most ~280 MB), errors kept apart so that
    invalid grammars never evict valid ones, and compiles on `workers` threads of their own
    within `timeout_s`. A compile that overran the deadline is remembered as an error, so a
    retry fails at once instead of compiling again; concurrent asks for one grammar share one
    compile."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...] = (),
                 cache_size: int = 256, timeout_s: float = 5.0, cache_bytes: int = 512 << 10,
                 workers: int = 2):
        # Every end-of-reply token ends a grammar's text: the tokenizer's EOS and `eos_ids`
        # (the checkpoint's generation_config ones).
        own = () if hf_tokenizer.eos_token_id is None else (hf_tokenizer.eos_token_id,)
        self.eos_ids = tuple(dict.fromkeys(own + tuple(eos_ids)))
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(self.eos_ids) or None)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._grammars = _Bounded(cache_size, cache_bytes)  # key -> LLMatcher
        self._errors = _Bounded(cache_size, cache_bytes)  # key -> GrammarError
        self._lock = threading.RLock()  # re-entered: a done compile's callback runs at once
        # At a lower CPU priority: a tenant's slow compile must not slow every stream.
        self._pool = background_pool(workers, "tandem-grammar")
        # A new session's matcher moved to its committed tokens and its first mask tried.
        self.masking = background_pool(workers, "tandem-grammar-admit")
        self._inflight: dict[str, Future] = {}  # key -> its compile under way

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it cannot compile (or
        could not within the deadline before), GrammarFailed if its first mask failed."""
        found = self._cached(spec)
        if found is None:
            found = self._compile_and_keep(spec)
        if isinstance(found, InvalidArgument):
            raise found
        return found.deep_copy()

    def _cached(self, spec: GrammarSpec) -> llguidance.LLMatcher | InvalidArgument | None:
        with self._lock:
            found = self._grammars.get(spec.key)
            return found if found is not None else self._errors.get(spec.key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def _compile_and_keep(self, spec: GrammarSpec) -> llguidance.LLMatcher | GrammarError:
        t0 = time.monotonic()
        found = self._compile(spec)
        if time.monotonic() - t0 > self.timeout_s:  # its caller gave up: never again
            found = self._too_slow(spec)
        if isinstance(found, GrammarError):
            self.remember_error(spec, found)
        else:
            with self._lock:
                self._grammars.put(spec.key, found, len(spec.source.encode()))
        return found

    def remember_error(self, spec: GrammarSpec, error: InvalidArgument) -> None:
        """Keep `error` for `spec` (a retry fails at once, in every process that asks) and
        drop its compiled grammar, if any. An error keeps only its message, so it is charged
        that, not its grammar's source: a tenant's wide failing schemas cannot evict the
        errors of others, nor any compiled grammar."""
        with self._lock:
            self._grammars.pop(spec.key)
            self._errors.put(spec.key, error, len(str(error).encode()))

    def state_now(self, spec: GrammarSpec, committed=(), matcher=None) -> GrammarState:
        """A session's grammar at `committed` tokens (InvalidArgument if they do not follow
        it), compiled here unless `matcher` is given."""
        st = GrammarState(matcher or self.matcher(spec), self.vocab_size, self.eos_ids)
        if not st.commit(list(committed)):
            raise InvalidArgument(f"committed_token_ids do not follow the {spec.kind.api_name}"
                                  f" grammar: {st.matcher.get_error()}")
        return st

    async def matcher_async(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """`matcher`, compiling on the compiler's own threads within the deadline; a cached
        grammar is answered at once, never behind someone else's compile."""
        found = self._cached(spec)
        if found is None:
            with self._lock:  # the first to ask compiles; the others wait for that compile
                pending = self._inflight.get(spec.key)
                found = self._cached(spec)  # done since the look above
                if pending is None and found is None:
                    pending = self._pool.submit(self._compile_and_keep, spec)
                    self._inflight[spec.key] = pending
                    pending.add_done_callback(lambda _, k=spec.key: self._forget(k))
            if found is None:
                found = await self._wait(spec, pending)
        if isinstance(found, InvalidArgument):
            raise found
        return found.deep_copy()

    async def _wait(self, spec: GrammarSpec, pending: Future):
        try:  # shielded: one caller's deadline must not cancel the others' compile
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending)),
                                          self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow(spec) from None

    def _too_slow(self, spec: GrammarSpec) -> GrammarError:
        return GrammarError(f"{spec.kind.api_name}: compiling took longer than "
                            f"{self.timeout_s:g} s")

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher | GrammarError:
        what = spec.kind.api_name
        try:
            grammar = spec.llguidance()
        except (ValueError, TypeError) as exc:
            return GrammarError(f"{what}: {exc}")
        why = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if why:
            return GrammarError(f"{what}: {short_reason(why, 3, 500)}")
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            return GrammarError(f"{what}: {short_reason(m.get_error(), 3, 500)}")
        return m


class _Bounded:
    """An LRU map bounded by entries and by the total size its values were put with."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def pop(self, key: str) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]

    def get(self, key: str):
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value, size: int) -> None:
        """Keep value (dropping the least recently used to make room); one larger than the
        whole budget is not kept at all."""
        self.pop(key)
        if size > self.max_bytes:
            return
        self._items[key] = (value, size)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self._items.popitem(last=False)[1][1]


class LazyCompiler:
    """A GrammarCompiler built off the event loop on first use, or at a process's start-up
    (`warm`, `build_now`): the serving processes build it before they take traffic: building
    it (loading a tokenizer and its imports, copying it into llguidance: 0.3-3 s, much of it
    holding the GIL) on the first tenant's grammar stalls every other stream of the process."""

    def __init__(self, load: Callable[[], GrammarCompiler]):
        self._load, self._compiler = load, None
        self._lock = asyncio.Lock()
        self._warming: asyncio.Future | None = None

    def warm(self) -> None:
        """Start building it now, on a thread, while the process has no traffic yet."""
        self._warming = asyncio.ensure_future(self.get())

    def build_now(self) -> GrammarCompiler:
        """Build it on this thread unless built (start-up, before any event loop serves)."""
        if self._compiler is None:
            self._compiler = self._load()
        return self._compiler

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
        """A session's grammar at its committed tokens, with its first mask tried, off the
        loop: GrammarError if it cannot compile, InvalidArgument if the committed tokens do
        not follow it, GrammarFailed if its first mask already breaks llguidance's limits
        (a row too wide, a lexer out of expressions): refused at admission, that session
        never holds up a step's batch with a mask that fails."""
        c = await self.get()
        matcher = await c.matcher_async(spec)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                c.masking, _ready_state, c, spec, committed, matcher)
        except GrammarFailed as exc:
            if not committed:  # the grammar itself fails at its start: never again
                c.remember_error(spec, exc)
            raise


def _ready_state(c: GrammarCompiler, spec: GrammarSpec, committed, matcher) -> GrammarState:
    state = c.state_now(spec, committed, matcher)
    state.check_start()  # raises GrammarFailed; the matcher ends where it was
    return state


def compiler_for(root: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    """The compiler of a checkpoint directory's tokenizer."""
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(str(root)), vocab_size, eos_ids)
