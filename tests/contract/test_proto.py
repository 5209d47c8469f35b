"""The wire contract: proto/tandem/v1/*.proto and the committed stubs generated from it."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from tools import protogen

pytestmark = pytest.mark.contract

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_FILES = protogen.proto_files(REPO_ROOT)


# --- (1) the committed stubs are what the pinned generator produces ------------------------


def test_proto_files_exist():
    names = [Path(p).name for p in PROTO_FILES]
    assert names == ["common.proto", "draft.proto", "verify.proto"]


def test_generated_stubs_are_not_stale():
    pytest.importorskip("grpc_tools")
    stale = protogen.stale_files(REPO_ROOT)
    assert not stale, (
        "generated stubs are stale; run `python -m tools.protogen` and commit: " + ", ".join(stale)
    )


# --- (2) the stubs import and the messages round-trip --------------------------------------


def _roundtrip(msg):
    data = msg.SerializeToString()
    back = type(msg).FromString(data)
    assert back == msg
    return back


def test_common_messages_roundtrip():
    from tandem.v1 import common_pb2

    s = _roundtrip(common_pb2.SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1234))
    assert s.HasField("seed") and s.seed == 1234
    assert not common_pb2.SamplingParams().HasField("seed")  # unset seed is distinguishable from 0
    assert common_pb2.SamplingParams(seed=0).HasField("seed")

    q = _roundtrip(common_pb2.SparseDistribution(token_ids=[5, 9, 2], probs=[0.5, 0.25, 0.25]))
    assert list(q.token_ids) == [5, 9, 2]
    assert list(q.probs) == [0.5, 0.25, 0.25]

    info = _roundtrip(
        common_pb2.WorkerInfo(
            role=common_pb2.WORKER_ROLE_DRAFT,
            model_id="tandem/draft-2l",
            tokenizer_hash="ab" * 32,
            vocab_size=49152,
            max_context_length=8192,
            max_sessions=64,
            max_spec_tokens=8,
            max_top_n=16,
            methods=[
                common_pb2.SPECULATION_METHOD_DRAFT_MODEL,
                common_pb2.SPECULATION_METHOD_NGRAM,
            ],
            version="0.1.0",
        )
    )
    assert list(info.methods) == [2, 3]
    _roundtrip(common_pb2.InfoRequest())


def test_draft_messages_roundtrip():
    from tandem.v1 import common_pb2, draft_pb2

    open_ = draft_pb2.DraftControl(
        open=draft_pb2.OpenSession(
            session_id="s1",
            token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0),
            method=common_pb2.SPECULATION_METHOD_NGRAM,
            max_run_ahead=6,
            top_n=8,
            epoch=0,
            max_ngram_size=3,
        )
    )
    back = _roundtrip(open_)
    assert back.WhichOneof("control") == "open"
    assert list(back.open.token_ids) == [1, 2, 3] and back.open.max_ngram_size == 3

    commit = _roundtrip(
        draft_pb2.DraftControl(
            commit=draft_pb2.CommitTokens(
                session_id="s1", epoch=2, start_position=3, token_ids=[4, 5], max_run_ahead=4
            )
        )
    )
    assert commit.WhichOneof("control") == "commit"
    assert commit.commit.start_position == 3 and commit.commit.epoch == 2
    # max_run_ahead has presence: unset leaves the limit alone, 0 pauses drafting.
    from draft_service.server import control_from_proto
    from tandem.spec import Commit
    from verify_service.drafts.link import control_to_proto
    for limit in (None, 0, 4):
        msg = _roundtrip(control_to_proto(Commit("s1", 2, 3, [4, 5], limit)))
        assert control_from_proto(msg).max_run_ahead == limit

    close = _roundtrip(draft_pb2.DraftControl(close=draft_pb2.CloseSession(session_id="s1")))
    assert close.WhichOneof("control") == "close"

    prop = _roundtrip(
        draft_pb2.DraftProposal(
            session_id="s1",
            epoch=2,
            position=5,
            token_id=42,
            q=common_pb2.SparseDistribution(token_ids=[42, 7], probs=[0.75, 0.25]),
        )
    )
    assert prop.position == 5 and prop.token_id == 42 and not prop.HasField("error")

    err = _roundtrip(
        draft_pb2.DraftProposal(
            session_id="nope",
            error=draft_pb2.DraftError(
                code=draft_pb2.DRAFT_ERROR_CODE_UNKNOWN_SESSION, message="no such session"
            ),
        )
    )
    assert err.HasField("error") and err.error.code == draft_pb2.DRAFT_ERROR_CODE_UNKNOWN_SESSION


def test_verify_messages_roundtrip():
    from tandem.v1 import common_pb2, verify_pb2

    req = _roundtrip(
        verify_pb2.GenerateRequest(
            session_id="s1",
            prompt_token_ids=[1, 2, 3],
            committed_token_ids=[4],
            sampling=common_pb2.SamplingParams(temperature=0.0),
            stopping=verify_pb2.StoppingCriteria(
                max_new_tokens=64, stop_token_ids=[2], ignore_eos=True
            ),
            speculation=verify_pb2.SpeculationConfig(
                method=common_pb2.SPECULATION_METHOD_DRAFT_MODEL,
                num_speculative_tokens=5,
                draft_address="draft-0:50052",
            ),
        )
    )
    assert list(req.committed_token_ids) == [4]
    assert req.stopping.ignore_eos and req.speculation.num_speculative_tokens == 5

    resp = _roundtrip(
        verify_pb2.GenerateResponse(
            token_ids=[7, 8, 9],
            num_committed=4,
            round=verify_pb2.RoundStats(
                drafted=3,
                accepted=2,
                bonus=False,
                draft_wait_ms=0.5,
                verify_ms=12.25,
                rejection_ms=0.125,
            ),
            totals=verify_pb2.SessionStats(rounds=2, drafted_tokens=3, accepted_tokens=2),
            finish_reason=verify_pb2.FINISH_REASON_LENGTH,
        )
    )
    assert resp.round.verify_ms == 12.25 and resp.totals.rounds == 2
    assert verify_pb2.GenerateResponse().finish_reason == verify_pb2.FINISH_REASON_UNSPECIFIED


def test_services_are_declared():
    from tandem.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

    draft = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]
    speculate = draft.methods_by_name["Speculate"]
    assert speculate.client_streaming and speculate.server_streaming
    assert draft.full_name == "tandem.v1.DraftService"
    verify = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"]
    generate = verify.methods_by_name["Generate"]
    assert not generate.client_streaming and generate.server_streaming
    for svc in (draft, verify):
        assert set(svc.methods_by_name) >= {"Info"}
    assert hasattr(draft_pb2_grpc, "DraftServiceStub") and hasattr(
        verify_pb2_grpc, "VerifyServiceStub"
    )


# --- (3) every element of the contract is documented ---------------------------------------

# Field numbers of the descriptor.proto messages, used to build SourceCodeInfo paths.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE = 2
_SERVICE_METHOD = 2


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory) -> descriptor_pb2.FileDescriptorSet:
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("protoset") / "contract.pb"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"-I{protogen._well_known_include()}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *PROTO_FILES,
        ],
        cwd=REPO_ROOT,
        check=False,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    assert len(fds.file) == len(PROTO_FILES)
    return fds


def _documented_elements(fd: descriptor_pb2.FileDescriptorProto):
    """Yield (path, human name) for every message, field, oneof, enum, value, service, method."""

    def enum(path, e, prefix):
        name = f"{prefix}{e.name}"
        yield path, f"enum {name}"
        for i, v in enumerate(e.value):
            yield path + (_ENUM_VALUE, i), f"enum value {name}.{v.name}"

    def message(path, m, prefix):
        name = f"{prefix}{m.name}"
        yield path, f"message {name}"
        for i, f in enumerate(m.field):
            yield path + (_MSG_FIELD, i), f"field {name}.{f.name}"
        for i, o in enumerate(m.oneof_decl):
            if o.name.startswith("_"):  # synthetic oneof of a proto3 `optional` field
                continue
            yield path + (_MSG_ONEOF, i), f"oneof {name}.{o.name}"
        for i, n in enumerate(m.nested_type):
            if n.options.map_entry:  # synthetic entry of a `map<,>` field, documented there
                continue
            yield from message(path + (_MSG_NESTED, i), n, f"{name}.")
        for i, e in enumerate(m.enum_type):
            yield from enum(path + (_MSG_ENUM, i), e, f"{name}.")

    for i, m in enumerate(fd.message_type):
        yield from message((_FILE_MESSAGE, i), m, "")
    for i, e in enumerate(fd.enum_type):
        yield from enum((_FILE_ENUM, i), e, "")
    for i, s in enumerate(fd.service):
        yield (_FILE_SERVICE, i), f"service {s.name}"
        for j, meth in enumerate(s.method):
            yield (_FILE_SERVICE, i, _SERVICE_METHOD, j), f"rpc {s.name}.{meth.name}"


def test_every_element_is_documented(descriptor_set):
    undocumented = []
    counted = 0
    for fd in descriptor_set.file:
        assert fd.package == "tandem.v1", fd.name
        locations = {tuple(loc.path): loc for loc in fd.source_code_info.location}
        for path, what in _documented_elements(fd):
            counted += 1
            loc = locations.get(path)
            if loc is None or not (loc.leading_comments.strip() or loc.trailing_comments.strip()):
                undocumented.append(f"{fd.name}: {what}")
    assert counted > 50  # the walk really visited the contract
    assert not undocumented, "undocumented proto elements:\n  " + "\n  ".join(undocumented)


# --- (4) enum naming ----------------------------------------------------------------------


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def test_enum_naming(descriptor_set):
    problems = []

    def check(e, prefix):
        want = _upper_snake(e.name) + "_"
        zero = [v for v in e.value if v.number == 0]
        if not zero or zero[0].name != want + "UNSPECIFIED":
            problems.append(f"{prefix}{e.name}: zero value must be {want}UNSPECIFIED")
        if e.value and e.value[0].number != 0:
            problems.append(f"{prefix}{e.name}: the zero value must come first")
        for v in e.value:
            if not v.name.startswith(want):
                problems.append(f"{prefix}{e.name}.{v.name}: must start with {want}")

    def walk(m, prefix):
        for e in m.enum_type:
            check(e, f"{prefix}{m.name}.")
        for n in m.nested_type:
            walk(n, f"{prefix}{m.name}.")

    enums = 0
    for fd in descriptor_set.file:
        for e in fd.enum_type:
            enums += 1
            check(e, "")
        for m in fd.message_type:
            walk(m, "")
    assert enums >= 4
    assert not problems, "\n".join(problems)


def test_upper_snake_helper():
    assert _upper_snake("SpeculationMethod") == "SPECULATION_METHOD"
    assert _upper_snake("DraftErrorCode") == "DRAFT_ERROR_CODE"


# --- (5) an in-process grpc.aio round trip ------------------------------------------------


def _draft_servicer():
    from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    class EchoDraft(draft_pb2_grpc.DraftServiceServicer):
        """Answers each OpenSession with one draft token: the last prompt token, greedy."""

        async def Speculate(self, request_iterator, context):
            sessions: dict[str, tuple[int, int]] = {}  # session_id -> (epoch, next position)
            async for ctl in request_iterator:
                kind = ctl.WhichOneof("control")
                if kind == "open":
                    o = ctl.open
                    sessions[o.session_id] = (o.epoch, len(o.token_ids))
                    yield draft_pb2.DraftProposal(
                        session_id=o.session_id,
                        epoch=o.epoch,
                        position=len(o.token_ids),
                        token_id=o.token_ids[-1],
                    )
                elif kind == "commit" and ctl.commit.session_id not in sessions:
                    yield draft_pb2.DraftProposal(
                        session_id=ctl.commit.session_id,
                        error=draft_pb2.DraftError(
                            code=draft_pb2.DRAFT_ERROR_CODE_UNKNOWN_SESSION, message="not open"
                        ),
                    )
                elif kind == "close":
                    sessions.pop(ctl.close.session_id, None)

        async def Info(self, request, context):
            return common_pb2.WorkerInfo(
                role=common_pb2.WORKER_ROLE_DRAFT,
                model_id="echo",
                vocab_size=100,
                methods=[common_pb2.SPECULATION_METHOD_NGRAM],
                version="test",
            )

    return EchoDraft()


async def _draft_roundtrip():
    from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServiceServicer_to_server(_draft_servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)

            info = await stub.Info(common_pb2.InfoRequest(), timeout=5)
            assert info.role == common_pb2.WORKER_ROLE_DRAFT
            assert list(info.methods) == [common_pb2.SPECULATION_METHOD_NGRAM]

            call = stub.Speculate(timeout=10)
            await call.write(
                draft_pb2.DraftControl(
                    open=draft_pb2.OpenSession(
                        session_id="s1",
                        token_ids=[11, 12, 13],
                        sampling=common_pb2.SamplingParams(temperature=0.0),
                        method=common_pb2.SPECULATION_METHOD_NGRAM,
                        epoch=3,
                    )
                )
            )
            prop = await call.read()
            assert (prop.session_id, prop.epoch, prop.position, prop.token_id) == ("s1", 3, 3, 13)
            assert not prop.HasField("error") and len(prop.q.token_ids) == 0

            # A problem with one session is reported in-band; the stream stays usable.
            await call.write(
                draft_pb2.DraftControl(commit=draft_pb2.CommitTokens(session_id="ghost", epoch=1))
            )
            err = await call.read()
            assert err.session_id == "ghost" and err.HasField("error")
            assert err.error.code == draft_pb2.DRAFT_ERROR_CODE_UNKNOWN_SESSION

            await call.write(
                draft_pb2.DraftControl(open=draft_pb2.OpenSession(session_id="s2", token_ids=[5]))
            )
            prop2 = await call.read()
            assert (prop2.session_id, prop2.position, prop2.token_id) == ("s2", 1, 5)

            await call.write(draft_pb2.DraftControl(close=draft_pb2.CloseSession(session_id="s1")))
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
    finally:
        await server.stop(grace=None)


def test_grpc_aio_draft_roundtrip():
    asyncio.run(asyncio.wait_for(_draft_roundtrip(), timeout=30))
