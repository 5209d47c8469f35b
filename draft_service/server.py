"""Thin grpc.aio servicer for DraftService: protobuf <-> tandem.spec dataclasses, nothing else.

The worker behind it (worker.py) never sees a `_pb2` type; building, serving and draining the
process is main.py's.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from draft_service.session import Stream
from draft_service.tracing import SessionSpans
from draft_service.worker import DraftWorker
from tandem.errors import InvalidArgument, Unavailable
from tandem.grammar import GrammarSpec
from tandem.sampling_params import SamplingParams
from tandem.spec import Close, Commit, Control, Features, Invalid, Open, Reply, SessionError
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def control_from_proto(msg: draft_pb2.DraftControl) -> Control:
    which = msg.WhichOneof("control")
    if which == "open":
        o = msg.open
        try:
            grammar = _grammar(o)
        except InvalidArgument as exc:
            return Invalid(o.session_id, str(exc))
        return Open(
            o.session_id, list(o.token_ids), *SamplingParams.wire_fields(o.sampling), o.method,
            o.max_run_ahead, o.top_n, o.epoch, o.max_ngram_size,
            trace_context=tuple(o.trace_context.items()),
            features=_features(o), tenant=o.tenant, tree=o.tree, grammar=grammar,
            grammar_start=o.grammar_start,
            controls=tuple(SamplingParams.control_fields(o.sampling).items()))
    if which == "commit":
        c = msg.commit
        return Commit(c.session_id, c.epoch, c.start_position, list(c.token_ids),
                      c.max_run_ahead if c.HasField("max_run_ahead") else None,
                      features=_features(c))
    if which == "close":
        return Close(msg.close.session_id)
    return Invalid("", "DraftControl has no control set")


def _grammar(o: draft_pb2.OpenSession) -> GrammarSpec | None:
    return GrammarSpec.from_wire(o.grammar if o.HasField("grammar") else None)


def _features(msg) -> Features | None:
    if not msg.HasField("features"):
        return None
    f = msg.features
    return Features(f.start_position, f.hidden_size, f.data)


def proposal_to_proto(item: Reply) -> draft_pb2.DraftProposal:
    if isinstance(item, SessionError):
        return draft_pb2.DraftProposal(
            session_id=item.session_id, epoch=item.epoch,
            error=draft_pb2.DraftError(code=int(item.code), message=item.message))
    tok, node = item.token, item.tree
    return draft_pb2.DraftProposal(
        session_id=item.session_id, epoch=item.epoch, position=item.position,
        token_id=tok.token_id,
        q=common_pb2.SparseDistribution(token_ids=tok.q_ids, probs=tok.q_probs),
        tree=None if node is None else draft_pb2.TreeNode(
            parent=node.parent, path_prob=node.path_prob, last=node.last))


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, worker: DraftWorker, info: common_pb2.WorkerInfo):
        self.worker = worker
        self.info = info
        self.draining = False
        # False once draining began (SIGUSR1): open streams go on, new ones are refused
        self.accepting = True

    async def Info(self, request, context):  # noqa: N802 (gRPC method name)
        return self.info

    async def Speculate(self, request_iterator, context):  # noqa: N802
        if not self.accepting:  # the verifier's DraftPool moves on to another worker
            raise Unavailable("draft worker is draining; connect to another one")
        stream = self.worker.open_stream()
        spans = SessionSpans()
        reader = asyncio.create_task(self._read(request_iterator, stream, spans))
        try:
            while (item := await stream.get()) is not None:
                spans.reply(item)
                yield proposal_to_proto(item)
        finally:
            spans.end_all()
            reader.cancel()
            self.worker.close_stream(stream)  # the verifier is gone: free its sessions
        if self.draining:
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details("draft worker is draining; reconnect to another one")

    async def _read(self, request_iterator, stream: Stream, spans: SessionSpans) -> None:
        requests = request_iterator.__aiter__()
        try:
            while True:
                try:
                    msg = await requests.__anext__()
                except StopAsyncIteration:
                    break
                except InvalidArgument as exc:  # one undecodable message (grpc_status): in-band
                    self.worker.handle(stream, Invalid("", str(exc)))
                    continue
                cmd = control_from_proto(msg)
                try:
                    spans.control(cmd)
                except Exception:  # telemetry must never break the stream
                    log.exception("tracing a draft session failed")
                self.worker.handle(stream, cmd)
        except asyncio.CancelledError:
            raise
        except Exception:  # transport trouble: end this stream, not the process
            log.exception("reading the Speculate stream failed")
        stream.put(None)  # the verifier half-closed (or the read failed): end the reply stream

    def end_streams(self) -> None:
        """Draining: end every stream with UNAVAILABLE so verifiers reconnect elsewhere."""
        self.draining = True
        self.worker.end_streams()
