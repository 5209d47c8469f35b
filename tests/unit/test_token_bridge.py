"""A draft with another tokenizer: the vocabulary map between SmolLM2's byte-level BPE and
Gemma 3's SentencePiece-style BPE (both real tokenizers, no model weights), and the
re-encoding of a session's text into the draft's ids."""
import json

import pytest
import torch

from tandem.models import fetch_model, resolve_model
from tandem.proposers.token_bridge import TextBridge, VocabMap, token_bytes

pytestmark = pytest.mark.unit


def _vocab(root) -> int:
    return json.loads((root / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def pair():
    from tokenizers import Tokenizer

    draft, target = resolve_model("SmolLM2-135M-Instruct").root, fetch_model("gemma3-270m")
    vocab = VocabMap.from_dirs(draft, _vocab(draft), target, _vocab(target))
    toks = [Tokenizer.from_file(str(r / "tokenizer.json")) for r in (draft, target)]
    return vocab, TextBridge(vocab, draft, target), toks[0], toks[1]


def test_mapped_pairs_decode_to_the_same_text_and_most_draft_tokens_map(pair):
    vocab, _, draft, target = pair
    assert vocab.size > 0.9 * len(vocab.draft_to_target)  # 46145 of SmolLM2's 49152
    checked = 0
    for d in vocab.draft_ids.tolist():
        a, b = draft.decode([d]), target.decode([int(vocab.draft_to_target[d])])
        if "\ufffd" not in a:  # a lone piece of a UTF-8 character decodes to U+FFFD
            assert a == b, (d, a, b)
            checked += 1
    assert checked > 0.99 * vocab.size


def test_the_map_is_one_to_one_and_leaves_special_tokens_out(pair):
    vocab, _, draft, target = pair
    d2t, t2d = vocab.draft_to_target, vocab.target_to_draft
    mapped = vocab.draft_ids
    assert len(set(d2t[mapped].tolist())) == vocab.size == int((t2d >= 0).sum())
    assert torch.equal(t2d[d2t[mapped]], mapped)
    for name, tok in (("<|im_end|>", draft), ("<|endoftext|>", draft)):
        assert d2t[tok.token_to_id(name)] == -1, name
    for name in ("<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"):
        assert t2d[target.token_to_id(name)] == -1, name
    # Gemma's "\n" exists as a plain token and as byte fallback <0x0A>: the plain one is kept
    newline = draft.token_to_id("Ċ")
    assert d2t[newline] == target.token_to_id("\n")


def test_token_bytes_reads_both_decoders():
    byte_level = {"model": {"vocab": {"Ġthe": 0, "Ċ": 1, "Ã©": 2}},
                  "decoder": {"type": "ByteLevel"}, "added_tokens": [
                      {"id": 3, "content": "<s>", "special": True}]}
    assert token_bytes(byte_level, 5) == [b" the", b"\n", "é".encode(), None, None]
    spm = {"model": {"vocab": {"▁the": 0, "<0x0A>": 1, "é": 2}},
           "decoder": {"type": "Sequence", "decoders": [
               {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
               {"type": "ByteFallback"}, {"type": "Fuse"}]}}
    assert token_bytes(spm, 3) == [b" the", b"\n", "é".encode()]
    unigram = {"model": {"type": "Unigram", "vocab": [["▁a", -1.0], ["<0xFF>", 0.0]]},
               "decoder": {"type": "Metaspace", "replacement": "▁"}}
    assert token_bytes(unigram, 2) == [b" a", b"<0xFF>"]  # no byte fallback declared
    with pytest.raises(ValueError, match="WordPiece"):
        token_bytes({"model": {"vocab": {}}, "decoder": {"type": "WordPiece"}}, 1)


def test_committed_text_is_re_encoded_and_drafts_map_back(pair):
    vocab, bridge, draft, target = pair
    text = "The quick brown fox jumps over the lazy dog, twice."
    ids = target.encode(text, add_special_tokens=True).ids  # with <bos>: dropped as text
    enc, n = bridge.draft_ids("s", ids, len(ids))
    assert n == len(enc) and draft.decode(enc) == text
    # drafts (target ids of shared tokens) continue as the draft's own ids, not re-encoded
    drafts = [int(vocab.draft_to_target[d]) for d in draft.encode(" The", " end").ids]
    out, n2 = bridge.draft_ids("s", ids + drafts, len(ids))
    assert n2 == n and out == enc + [int(vocab.target_to_draft[t]) for t in drafts]
    # committing a token that merges with the text before it re-encodes the whole text
    more = target.encode(" lazy dogs", add_special_tokens=False).ids
    out, n3 = bridge.draft_ids("s", ids + more, len(ids + more))
    assert draft.decode(out) == text + " lazy dogs" and n3 == len(out)
    assert bridge.draft_ids("t", [target.token_to_id("<bos>")], 1)[0]  # never empty


def test_tandem_up_passes_another_targets_tokenizer_to_its_draft_model():
    from tools.launcher import Cluster, ClusterConfig

    gemma = str(resolve_model("gemma3-270m").root)
    args = Cluster(ClusterConfig(model="gemma3-270m", draft_model="SmolLM2-135M-Instruct"),
                   log=lambda *_: None)._draft_args()
    assert args == ["--model", "SmolLM2-135M-Instruct", "--eagle", "none",
                    "--tokenizer", gemma]
    history = Cluster(ClusterConfig(model="gemma3-270m"), log=lambda *_: None)._draft_args()
    assert history[:2] == ["--model", "none"] and history[-1] == gemma
