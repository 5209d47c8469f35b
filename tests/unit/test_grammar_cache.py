"""The grammar compiler's bounds (issue 47): errors never evict compiled grammars, the cache
holds at most its byte budget of grammar source, a compile that overran the deadline is not
compiled again, one grammar asked for at once compiles once, and a cached grammar is answered
while another's compile is under way."""
import asyncio
import threading

import pytest

from tandem.grammar.compiler import GrammarCompiler, GrammarError, LazyCompiler
from tandem.grammar.spec import GrammarKind, GrammarSpec
from tandem.grammar.state import GrammarFailed

pytestmark = pytest.mark.unit


@pytest.fixture
def compiler(tokenizer):
    """A fresh compiler (its caches are the subject) over the real tokenizer."""
    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,),
                           cache_size=4, cache_bytes=64, timeout_s=1.0)


def _regex(i: int, width: int = 1) -> GrammarSpec:
    return GrammarSpec(GrammarKind.REGEX, f"(a{i}|b){{1,{width}}}")


def _counting(compiler, monkeypatch, gate: threading.Event | None = None,
              delay_s: float = 0.0) -> list[str]:
    compiled, real = [], compiler._compile

    def counted(spec):
        compiled.append(spec.source)
        if gate is not None:
            gate.wait(10)
        if delay_s:
            threading.Event().wait(delay_s)
        return real(spec)
    monkeypatch.setattr(compiler, "_compile", counted)
    return compiled


def test_invalid_grammars_never_evict_a_compiled_one(compiler, monkeypatch):
    good = _regex(1)
    compiler.matcher(good)
    compiled = _counting(compiler, monkeypatch)
    for i in range(20):  # many fast 400s, more than the cache holds
        with pytest.raises(GrammarError):
            compiler.matcher(GrammarSpec(GrammarKind.REGEX, f"({i}"))
    compiler.matcher(good)
    assert good.source not in compiled  # still cached: not compiled again


def test_the_cache_holds_at_most_its_byte_budget(tokenizer, monkeypatch):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), cache_size=100, cache_bytes=64)
    specs = [_regex(i, 9) for i in range(10)]  # 11 bytes of source each: "(a0|b){1,9}"
    for spec in specs:
        compiler.matcher(spec)
    assert compiler._grammars.bytes <= 64 and len(compiler._grammars) == 64 // 11
    wide = GrammarSpec(GrammarKind.REGEX, "(" + "|".join(f"w{i}" for i in range(30)) + ")")
    compiled = _counting(compiler, monkeypatch)
    compiler.matcher(wide)
    compiler.matcher(wide)  # larger than the whole budget: served, never kept
    assert compiled == [wide.source] * 2 and compiler._grammars.bytes <= 64


def test_a_compile_past_the_deadline_is_refused_again_without_compiling(compiler, monkeypatch):
    compiled = _counting(compiler, monkeypatch, delay_s=1.3)
    slow = _regex(7)

    async def ask():
        with pytest.raises(GrammarError, match="longer than 1 s"):
            await compiler.matcher_async(slow)
        await asyncio.sleep(0.5)  # the compile ends after its caller gave up
        with pytest.raises(GrammarError, match="longer than 1 s"):
            await compiler.matcher_async(slow)
    asyncio.run(ask())
    assert compiled == [slow.source]  # the retry did not compile it again


def test_one_grammar_asked_for_at_once_compiles_once(compiler, monkeypatch):
    compiled = _counting(compiler, monkeypatch, delay_s=0.2)
    spec = _regex(3)

    async def ask():
        return await asyncio.gather(*(compiler.matcher_async(spec) for _ in range(6)))
    matchers = asyncio.run(ask())
    assert compiled == [spec.source] and len({id(m) for m in matchers}) == 6  # own copies


def test_a_cached_grammar_is_answered_while_another_compiles(compiler, monkeypatch):
    cached = _regex(5)
    compiler.matcher(cached)
    gate = threading.Event()
    _counting(compiler, monkeypatch, gate=gate)

    async def ask():
        slow = asyncio.ensure_future(compiler.matcher_async(_regex(6)))
        await asyncio.sleep(0.05)  # the slow compile holds a worker
        got = await asyncio.wait_for(compiler.matcher_async(cached), 0.5)
        done_first = not slow.done()
        gate.set()
        await slow
        return got, done_first
    got, done_first = asyncio.run(ask())
    assert got is not None and done_first


POISON = GrammarSpec(GrammarKind.REGEX, "([a-z ]{1,50}){1,50}")


def _exhaust(compiler, tokenizer) -> None:
    """Walk the poison regex until llguidance's lexer, shared by every copy of the compiled
    grammar, runs out of expressions: from then on its very first mask fails."""
    state = compiler.state_now(POISON)
    with pytest.raises(GrammarFailed):
        for t in tokenizer.encode(" use commas to separate items in a sentence that is long",
                                  add_special_tokens=False):
            state.check_start()
            state.commit([t])


def test_a_grammar_whose_first_mask_fails_is_refused_again_without_compiling(
        tokenizer, monkeypatch):
    """Admission's failure is kept like a compile error: a retry (in the gateway, then in
    every verifier) costs a cache look, not a compile and a mask; the broken compiled
    grammar is dropped."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    lazy = LazyCompiler(lambda: compiler)
    _exhaust(compiler, tokenizer)
    compiled = _counting(compiler, monkeypatch)
    with pytest.raises(GrammarFailed, match="too many expressions"):
        asyncio.run(lazy.state(POISON))
    assert compiler._grammars.get(POISON.key) is None
    for _ in range(3):
        with pytest.raises(GrammarFailed, match="too many expressions"):
            asyncio.run(lazy.state(POISON))
        with pytest.raises(GrammarFailed):
            compiler.matcher(POISON)
    assert compiled == []


def test_an_error_is_charged_its_message_not_its_source(tokenizer, monkeypatch):
    """A wide invalid grammar (its source over the whole byte budget) is still remembered:
    errors keep only a message, so retrying it never compiles again."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), cache_bytes=1024)
    wide = GrammarSpec(GrammarKind.REGEX, "(" + "a" * 4000)
    compiled = _counting(compiler, monkeypatch)
    for _ in range(3):
        with pytest.raises(GrammarError):
            compiler.matcher(wide)
    assert compiled == [wide.source]


def test_the_gateway_refuses_a_grammar_whose_first_mask_fails(tokenizer):
    """The gateway tries the first mask too (torch-free), so such a grammar is a 400 before
    any verifier compiles it or a session is opened."""
    from gateway.errors import APIError
    from gateway.plan import _check_grammar

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    _exhaust(compiler, tokenizer)
    with pytest.raises(APIError) as err:
        asyncio.run(_check_grammar(POISON, LazyCompiler(lambda: compiler), ""))
    assert err.value.status == 400 and "cannot be served" in err.value.message


def test_a_warmed_compiler_is_built_before_any_grammar_is_asked_for(tokenizer):
    built = []

    async def start():
        lazy = LazyCompiler(lambda: built.append(1) or GrammarCompiler(tokenizer, len(tokenizer)))
        lazy.warm()
        await asyncio.sleep(0)
        await lazy._warming
        return lazy
    lazy = asyncio.run(start())
    assert built == [1] and lazy.now() is not None
    assert LazyCompiler(lambda: None).build_now() is None  # the loader's result, on this thread
