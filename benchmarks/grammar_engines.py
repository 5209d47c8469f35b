"""llguidance against xgrammar on this tokenizer: tokenizer set-up, compile and per-token mask
cost for a JSON schema (why tandem.grammar uses llguidance: docs/design/structured.md).

  pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi   # not a dependency
  python benchmarks/grammar_engines.py [--xgrammar-path /tmp/xg]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "kind": {"enum": ["a", "b", "c"]}}}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "kind": "b"})


def llguidance_run(tok, ids: list[int]) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = allocate_token_bitmask(1, lt.vocab_size)
    for t in ids:
        fill_next_token_bitmask(m, mask, 0)
        m.consume_token(t)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, (t3 - t2) / len(ids)


def xgrammar_run(tok, ids: list[int]) -> tuple[float, float, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for t in ids:
        m.fill_next_token_bitmask(mask, 0)
        m.accept_token(t)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, (t3 - t2) / len(ids)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xgrammar-path", default="", help="where xgrammar was pip-installed")
    args = ap.parse_args(argv)
    if args.xgrammar_path:
        sys.path.append(args.xgrammar_path)
    from transformers import AutoTokenizer

    from tandem.models import DEFAULT_TARGET, model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir(DEFAULT_TARGET)))
    ids = tok(ANSWER, add_special_tokens=False).input_ids
    for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
        try:
            setup, compile_s, mask_s = run(tok, ids)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        print(f"{name}: tokenizer {setup * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, "
              f"mask {mask_s * 1e3:.3f} ms per token over {len(ids)} tokens")


if __name__ == "__main__":
    main()
