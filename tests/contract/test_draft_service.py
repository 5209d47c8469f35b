"""DraftService over real gRPC (in-process grpc.aio on 127.0.0.1:0), driven as a verifier would.

The draft model is a tiny random Llama on the real target's tokenizer (the shipped draft is
trained separately); its lm_head is scaled up so greedy argmaxes are far from ties and token
identity with a plain greedy run is a fair test (and greedy output is not one repeated token).
"""
import asyncio
import shutil

import grpc
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.config import DraftConfig
from draft_service.main import build_app, build_server
from draft_service.server import SERVICE_NAME
from tandem.engine.generate import LocalGenerator
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths, tokenizer_hash
from tandem.proposers.ngram import ngram_lookup
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.contract

DRAFT_MODEL = common_pb2.SPECULATION_METHOD_DRAFT_MODEL
NGRAM = common_pb2.SPECULATION_METHOD_NGRAM
SUFFIX = common_pb2.SPECULATION_METHOD_SUFFIX
E = draft_pb2  # error codes: E.DRAFT_ERROR_CODE_*


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, target_paths):
    path = tmp_path_factory.mktemp("tiny-draft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked logits: greedy argmaxes far from ties, varied tokens
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_paths.root / name, path / name)
    return path


@pytest.fixture(scope="module")
def greedy_reference(tiny_draft):
    gen = LocalGenerator(ModelRunner(LlamaModel.load(ModelPaths(tiny_draft)), 64, 16))

    def continuation(prompt, n):
        return gen.generate([prompt], SamplingParams(temperature=0.0), n)[0]
    return continuation


def config(model, **kw):
    return DraftConfig(host="127.0.0.1", port=0, model=None if model is None else str(model),
                       kv_cache_mb=1, drain_grace_s=0.2, **kw)


def open_msg(session_id, tokens, method=DRAFT_MODEL, epoch=0, run_ahead=4, temperature=0.0, top_n=0,
             tenant="", **kw):
    sampling = common_pb2.SamplingParams(temperature=temperature, **kw)
    return draft_pb2.DraftControl(open=draft_pb2.OpenSession(
        session_id=session_id, token_ids=tokens, sampling=sampling, method=method,
        max_run_ahead=run_ahead, epoch=epoch, top_n=top_n, tenant=tenant))


def commit_msg(session_id, epoch, start, tokens):
    return draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(
        session_id=session_id, epoch=epoch, start_position=start, token_ids=tokens))


async def read(call, want, errors=0, timeout=10.0):
    """Read until each session in `want` has that many proposals and `errors` errors came."""
    got = {session_id: [] for session_id in want}
    errs = []
    while any(len(got[s]) < n for s, n in want.items()) or len(errs) < errors:
        msg = await asyncio.wait_for(call.read(), timeout)
        assert msg is not grpc.aio.EOF, "stream ended early"
        if msg.HasField("error"):
            errs.append(msg)
        else:
            got.setdefault(msg.session_id, []).append(msg)
    return got, errs


def with_server(cfg, scenario):
    async def main():
        app = await build_app(cfg)
        await app.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
                await scenario(app, channel)
        finally:
            await app.server.stop(None)
            await app.worker.aclose()
    asyncio.run(asyncio.wait_for(main(), 50))


def test_sampled_and_greedy_sessions_commit_and_rollback(tiny_draft):
    prompt_a, prompt_b = [1, 2, 3, 4, 5], list(range(100, 120))

    async def scenario(app, channel):
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        await call.write(open_msg("a", prompt_a, epoch=2, temperature=1.0, seed=3, top_k=50,
                                  run_ahead=4))
        await call.write(open_msg("b", prompt_b, run_ahead=3))
        got, _ = await read(call, {"a": 4, "b": 3})
        assert [p.position for p in got["a"]] == [5, 6, 7, 8]
        assert [p.position for p in got["b"]] == [20, 21, 22]
        assert {p.epoch for p in got["a"]} == {2} and {p.epoch for p in got["b"]} == {0}
        for p in got["a"]:  # the exact top-N truncated q the token was sampled from
            assert 1 <= len(p.q.token_ids) <= 8 and len(p.q.probs) == len(p.q.token_ids)
            assert abs(sum(p.q.probs) - 1.0) < 1e-5 and min(p.q.probs) > 0
            assert p.token_id in p.q.token_ids
            assert list(p.q.probs) == sorted(p.q.probs, reverse=True)
        assert all(not p.q.token_ids and not p.q.probs for p in got["b"])  # greedy: ids only

        # b: two drafts accepted, same epoch -> its third draft stays valid, drafting goes on.
        b = [p.token_id for p in got["b"]]
        await call.write(commit_msg("b", 0, 20, b[:2]))
        more, _ = await read(call, {"b": 2})
        assert [(p.position, p.epoch) for p in more["b"]] == [(23, 0), (24, 0)]

        # a: first draft accepted, then a recovered token -> epoch 3, drafting from the end.
        a = [p.token_id for p in got["a"]]
        recovered = (a[1] + 1) % 49152
        await call.write(commit_msg("a", 3, 5, [a[0], recovered]))
        more, _ = await read(call, {"a": 4})
        assert [(p.position, p.epoch) for p in more["a"]] == [(7, 3), (8, 3), (9, 3), (10, 3)]
        call.cancel()
        blocks = app.worker.proposers[Method.DRAFT_MODEL].blocks
        for _ in range(100):  # the stream ending frees its sessions and their KV blocks
            if app.worker.load() == 0 and blocks.num_free_blocks == blocks.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert app.worker.load() == 0 and blocks.num_free_blocks == blocks.num_blocks

    with_server(config(tiny_draft), scenario)


def test_bad_inputs_are_in_band_and_spare_other_sessions(tiny_draft):
    async def scenario(app, channel):
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        await call.write(open_msg("good", [7, 8, 9], run_ahead=2))
        await call.write(open_msg("victim", [7, 8], epoch=5, run_ahead=1))
        got, _ = await read(call, {"good": 2, "victim": 1})
        bad = [
            (open_msg("oov", [1, 49152]), "oov", E.DRAFT_ERROR_CODE_INVALID_ARGUMENT),
            (open_msg("", [1]), "", E.DRAFT_ERROR_CODE_INVALID_ARGUMENT),
            (commit_msg("ghost", 0, 0, [1]), "ghost", E.DRAFT_ERROR_CODE_UNKNOWN_SESSION),
            (commit_msg("victim", 4, 2, [1]), "victim", E.DRAFT_ERROR_CODE_INVALID_ARGUMENT),
            (draft_pb2.DraftControl(), "", E.DRAFT_ERROR_CODE_INVALID_ARGUMENT),
            (open_msg("t", [1], temperature=1.0, top_p=1.5), "t",
             E.DRAFT_ERROR_CODE_INVALID_ARGUMENT),
            (open_msg("none", [1], method=common_pb2.SPECULATION_METHOD_NONE), "none",
             E.DRAFT_ERROR_CODE_UNSUPPORTED_METHOD),
            (open_msg("long", [1] * 300), "long", E.DRAFT_ERROR_CODE_RESOURCE_EXHAUSTED),
        ]
        for msg, _, _ in bad:
            await call.write(msg)
        # The good session keeps drafting: accept its drafts and expect more.
        await call.write(commit_msg("good", 0, 3, [p.token_id for p in got["good"]]))
        more, errs = await read(call, {"good": 2}, errors=len(bad))
        assert [(e.session_id, e.error.code) for e in errs] == [(s, c) for _, s, c in bad]
        assert all(e.error.message for e in errs)
        assert [p.position for p in more["good"]] == [5, 6]
        assert app.worker.load() == 1
        call.cancel()

    with_server(config(tiny_draft), scenario)


def test_greedy_drafts_equal_plain_greedy_decoding(tiny_draft, greedy_reference):
    shared = list(range(300, 340))  # 40 tokens: full blocks shared between the sessions
    prompts = {"x": shared + [1, 2], "y": shared + [5], "z": [42] * 7}

    async def scenario(app, channel):
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        for session_id, prompt in prompts.items():
            await call.write(open_msg(session_id, prompt, run_ahead=8))
        got, _ = await read(call, {session_id: 8 for session_id in prompts})
        for session_id, prompt in prompts.items():
            assert [p.token_id for p in got[session_id]] == greedy_reference(prompt, 8), session_id
            assert len({p.token_id for p in got[session_id]}) > 2  # a non-trivial continuation
        # Accept x's drafts: the continuation goes on; diverge y: the rolled-back cache must
        # continue the new sequence exactly like a fresh greedy run.
        x = [p.token_id for p in got["x"]]
        await call.write(commit_msg("x", 0, len(prompts["x"]), x))
        y_new = prompts["y"] + [p.token_id for p in got["y"][:3]] + [999]
        await call.write(commit_msg("y", 1, len(prompts["y"]), y_new[len(prompts["y"]):]))
        more, _ = await read(call, {"x": 8, "y": 8})
        assert x + [p.token_id for p in more["x"]] == greedy_reference(prompts["x"], 16)
        assert [p.token_id for p in more["y"]] == greedy_reference(y_new, 8)
        assert {p.epoch for p in more["y"]} == {1}
        call.cancel()

    with_server(config(tiny_draft), scenario)


def test_full_kv_cache_fails_only_the_sessions_that_do_not_fit(tiny_draft):
    async def scenario(app, channel):
        blocks = app.worker.proposers[Method.DRAFT_MODEL].blocks
        per_session = 200 // 16 + 1
        fit = blocks.num_blocks // per_session
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        for i in range(fit + 2):  # distinct prompts: no prefix sharing
            await call.write(open_msg(f"s{i}", [i + 1] * 200, run_ahead=1))
        got, errs = await read(call, {f"s{i}": 1 for i in range(fit)}, errors=2)
        assert {e.error.code for e in errs} == {E.DRAFT_ERROR_CODE_RESOURCE_EXHAUSTED}
        assert app.worker.load() == fit
        call.cancel()

    with_server(config(tiny_draft), scenario)


def test_ngram_sessions_send_one_message_per_token(tiny_draft):
    prompt = [10, 11, 12, 13, 14, 15, 10, 11, 12]

    async def scenario(app, channel):
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        await call.write(open_msg("n", prompt, method=NGRAM, run_ahead=5, epoch=1))
        got, _ = await read(call, {"n": 5})
        assert [p.token_id for p in got["n"]] == ngram_lookup(prompt, 3, 5)
        assert [p.position for p in got["n"]] == list(range(9, 14))
        assert all(not p.q.token_ids and p.epoch == 1 for p in got["n"])
        call.cancel()

    with_server(config(tiny_draft), scenario)


def test_suffix_sessions_draft_from_earlier_sessions_of_their_tenant(tiny_draft):
    answer = list(range(300, 312))
    question = [20, 21, 22, 23, 24, 25]

    async def scenario(app, channel):
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        # a finished session of tenant "t1": its text goes into t1's cache on close
        await call.write(open_msg("a", question + answer, method=SUFFIX, tenant="t1"))
        await call.write(draft_pb2.DraftControl(close=draft_pb2.CloseSession(session_id="a")))
        await call.write(open_msg("b", question, method=SUFFIX, run_ahead=4, tenant="t1"))
        got, _ = await read(call, {"b": 4})
        assert [p.token_id for p in got["b"]] == answer[:4]
        assert all(not p.q.token_ids for p in got["b"])  # one-hot
        # another tenant shares nothing; it is stalled (no drafts) until a commit
        await call.write(open_msg("c", question, method=SUFFIX, run_ahead=4, tenant="t2"))
        await call.write(open_msg("d", [7, 8, 9, 5, 7, 8, 9], method=SUFFIX, run_ahead=1,
                                  tenant="t2"))  # its own text still drafts
        got, _ = await read(call, {"d": 1})
        assert [p.token_id for p in got["d"]] == [5] and not got.get("c")
        call.cancel()

    with_server(config(tiny_draft, suffix_scope="tenant"), scenario)


def test_health_reflection_and_info(tiny_draft, target_paths):
    async def scenario(app, channel):
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await refl.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await asyncio.wait_for(refl.read(), 5)
        names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        refl.cancel()
        info = await draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(),
                                                                   timeout=5)
        assert info.role == common_pb2.WORKER_ROLE_DRAFT
        assert info.tokenizer_hash == tokenizer_hash(target_paths)
        assert (info.vocab_size, info.max_context_length) == (49152, 256)
        assert list(info.methods) == [DRAFT_MODEL, NGRAM, SUFFIX]
        assert info.max_spec_tokens == 16 and info.max_top_n == 64 and info.version

    with_server(config(tiny_draft), scenario)


def test_ngram_only_worker_info(target_paths):
    async def scenario(app, channel):
        info = await draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(),
                                                                   timeout=5)
        assert list(info.methods) == [NGRAM, SUFFIX] and info.model_id == "ngram"
        assert info.tokenizer_hash == tokenizer_hash(target_paths)
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        await call.write(open_msg("d", [1, 2], method=DRAFT_MODEL))
        _, errs = await read(call, {}, errors=1)
        assert errs[0].error.code == E.DRAFT_ERROR_CODE_UNSUPPORTED_METHOD
        call.cancel()

    with_server(config(None, tokenizer=str(target_paths.root)), scenario)


def test_drain_sets_not_serving_and_ends_streams_unavailable(tiny_draft):
    async def main():
        app = await build_app(config(tiny_draft))
        await app.server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
            await call.write(open_msg("a", [1, 2, 3], run_ahead=2))
            await read(call, {"a": 2})
            draining = asyncio.create_task(app.drain(0.5))
            await asyncio.sleep(0.1)
            assert (await app.health.Check(health_pb2.HealthCheckRequest(service=""), None)
                    ).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Within the grace period the open stream still works: commit, get more drafts.
            await call.write(commit_msg("a", 1, 3, [5]))
            got, _ = await read(call, {"a": 2})
            assert [(p.position, p.epoch) for p in got["a"]] == [(4, 1), (5, 1)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    msg = await asyncio.wait_for(call.read(), 5)
                    assert msg is not grpc.aio.EOF
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await draining
    asyncio.run(asyncio.wait_for(main(), 30))


def test_build_server_helper_binds_an_ephemeral_port(tiny_draft):
    async def main():
        server, port = await build_server(config(None))
        assert port > 0
        await server.start()
        await server.stop(None)
    asyncio.run(main())


def test_serve_drains_on_sigterm(target_paths):
    import os
    import signal

    from draft_service.main import serve

    addresses = []

    def ready(address):
        addresses.append(address)
        # serve() installs its handlers right after this returns, well within 0.2 s.
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)

    cfg = config(None, tokenizer=str(target_paths.root), threads=torch.get_num_threads())
    asyncio.run(asyncio.wait_for(serve(cfg, ready=ready), 10))
    assert addresses and addresses[0].startswith("127.0.0.1:")
    assert int(addresses[0].rsplit(":", 1)[1]) > 0


def test_draft_model_cache_reuse_matches_a_fresh_computation(tiny_draft):
    """Random appends, divergences (rollbacks) and commits on cached sessions, two of which
    share a prefix, must propose exactly what a cold cache proposes for the same sequence."""
    import random

    from tandem.proposers.draft_model import DraftModelProposer
    from tandem.spec import DraftRequest

    model = LlamaModel.load(ModelPaths(tiny_draft))
    warm = DraftModelProposer(ModelRunner(model, num_blocks=256, block_size=4))
    rng = random.Random(0)
    shared = [rng.randrange(49152) for _ in range(9)]
    seqs = {"a": shared + [1], "b": shared + [2]}
    committed = {"a": 10, "b": 10}
    for _ in range(40):
        session_key = rng.choice("ab")
        seq, op = seqs[session_key], rng.random()
        if op < 0.3 and len(seq) > committed[session_key]:  # the verifier commits some drafts
            committed[session_key] = rng.randint(committed[session_key], len(seq))
        elif op < 0.6:  # diverge: cut back to a random point past the committed tokens
            cut = rng.randint(committed[session_key], len(seq))
            seqs[session_key] = seq[:cut] + [rng.randrange(49152)]
        req = DraftRequest(session_key=session_key, token_ids=list(seqs[session_key]),
                           num_committed=committed[session_key], max_tokens=1)
        cold = DraftModelProposer(ModelRunner(model, num_blocks=64, block_size=4))
        (got,), (want,) = warm.propose([req]), cold.propose([req])
        assert got.tokens == want.tokens
        if op >= 0.6:  # append the draft, as the worker does while running ahead
            seqs[session_key] = seqs[session_key] + [got.tokens[0].token_id]
    warm.release("a")
    warm.release("b")
    assert warm.blocks.num_free_blocks == warm.blocks.num_blocks


def test_truncated_vocabulary_draft_speaks_target_ids(tmp_path, target_paths):
    """A draft whose head keeps only some target tokens (draft_vocab.json, like the shipped
    draft): its q and tokens are target ids from the kept set; Info shows the target vocab."""
    from tandem.engine.draft_vocab import DraftVocab

    kept = sorted(torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:500])
    cfg = transformers.LlamaConfig(
        vocab_size=len(kept), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    DraftVocab(tuple(int(t) for t in kept), 49152).write(tmp_path)
    shutil.copy(target_paths.root / "tokenizer.json", tmp_path / "tokenizer.json")
    kept_set = {int(t) for t in kept}

    async def scenario(app, channel):
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        assert (await stub.Info(common_pb2.InfoRequest(), timeout=5)).vocab_size == 49152
        call = stub.Speculate()
        # Prompt ids outside the kept set are valid target ids: they must be accepted.
        await call.write(open_msg("t", [49151, 3, 17], temperature=1.0, top_n=16, seed=1))
        await call.write(open_msg("g", [5, 6], run_ahead=3))
        got, _ = await read(call, {"t": 4, "g": 3})
        for p in got["t"]:
            assert set(p.q.token_ids) <= kept_set and len(p.q.token_ids) == 16
        assert {p.token_id for p in got["t"] + got["g"]} <= kept_set
        call.cancel()

    with_server(config(tmp_path), scenario)


def test_eagle_tree_sessions_stream_one_numbered_tree_per_epoch(target_paths, eagle_dir):
    """A tree session over the wire: nodes carry TreeNode (parent among earlier nodes, score,
    the last one marked) at depth positions; every commit (a new epoch) brings a new tree; a
    chains-only method refuses trees in-band."""
    import numpy as np

    prompt = [1, 504, 3060, 314, 260]
    hidden = 576
    rng = np.random.default_rng(0)

    def feats(start, rows):
        data = rng.standard_normal((rows, hidden)).astype("<f2").tobytes()
        return draft_pb2.TargetFeatures(start_position=start, hidden_size=hidden, data=data)

    def check_tree(msgs, length, epoch, size):
        assert len(msgs) == size and msgs[-1].tree.last
        assert not any(m.tree.last for m in msgs[:-1])
        depth = []
        for j, m in enumerate(msgs):
            assert m.HasField("tree") and m.epoch == epoch and -1 <= m.tree.parent < j
            depth.append(1 if m.tree.parent < 0 else depth[m.tree.parent] + 1)
            assert m.position == length + depth[-1] - 1
            assert 0 < m.tree.path_prob <= 1 and len(m.q.token_ids) == 0  # one-hot q
        scores = [m.tree.path_prob for m in msgs]
        assert scores == sorted(scores, reverse=True) and max(depth) >= 2
        assert len({m.tree.parent for m in msgs}) < size  # siblings: a tree, not a chain

    async def scenario(app, channel):
        call = draft_pb2_grpc.DraftServiceStub(channel).Speculate()
        msg = open_msg("t", prompt, method=common_pb2.SPECULATION_METHOD_EAGLE, run_ahead=6)
        msg.open.tree = True
        msg.open.features.CopyFrom(feats(0, len(prompt) - 1))
        await call.write(msg)
        got, _ = await read(call, {"t": 6})
        check_tree(got["t"], len(prompt), 0, 6)
        first = got["t"][0].token_id
        commit = commit_msg("t", 1, len(prompt), [first, 77])
        commit.commit.features.CopyFrom(feats(len(prompt) - 1, 2))
        await call.write(commit)
        got, _ = await read(call, {"t": 6})
        check_tree(got["t"], len(prompt) + 2, 1, 6)
        bad = open_msg("n", prompt, method=NGRAM)
        bad.open.tree = True
        await call.write(bad)
        _, errs = await read(call, {}, errors=1)
        assert errs[0].session_id == "n"
        assert errs[0].error.code == E.DRAFT_ERROR_CODE_INVALID_ARGUMENT
        await call.done_writing()

    with_server(config(None, eagle=str(eagle_dir), tokenizer=str(target_paths.root)), scenario)
