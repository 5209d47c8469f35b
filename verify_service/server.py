"""Thin grpc.aio servicer for VerifyService: protobuf <-> dataclasses, nothing else.

Errors are raised as tandem.errors types; tandem.grpc_status.StatusInterceptor (installed by
verify_service/main.py) turns them into status codes.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from opentelemetry import trace

from tandem import telemetry, tracing
from tandem.errors import InvalidArgument, SessionFailed, Unavailable
from tandem.grammar import GrammarSpec
from tandem.grammar.compiler import LazyCompiler
from tandem.grpc_limits import MAX_SESSION_ID_CHARS, MAX_STOP_TOKEN_IDS
from tandem.sampling_params import SamplingParams
from tandem.spec import Method
from tandem.spec.methods import AUTO_DRAFT_METHODS
from tandem.telemetry import VerifierMetrics
from tandem.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.engine import Engine
from verify_service.session.params import GenerateParams
from verify_service.sessions import RoundOutput

log = logging.getLogger(__name__)
SERVICE_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name
_FINISH = {None: verify_pb2.FINISH_REASON_UNSPECIFIED, "stop": verify_pb2.FINISH_REASON_STOP,
           "length": verify_pb2.FINISH_REASON_LENGTH, "abort": verify_pb2.FINISH_REASON_ABORT}
# The methods whose sessions draft trees when neither the request nor the server says
# (VerifierConfig.tree_methods says for a served verifier).
MEDUSA_TREES = frozenset({Method.MEDUSA})


def _check_sizes(req: verify_pb2.GenerateRequest, info: common_pb2.WorkerInfo) -> None:
    """Lengths first (cheap, and they bound the scans after them), then the ids."""
    if len(req.session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidArgument(f"session_id has {len(req.session_id)} characters, more than "
                              f"{MAX_SESSION_ID_CHARS}")
    stops = req.stopping.stop_token_ids
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(stops)} ids, more than "
                              f"{MAX_STOP_TOKEN_IDS}")
    prompt, ctx = req.prompt_token_ids, info.max_context_length
    max_new = req.stopping.max_new_tokens
    if len(prompt) + max_new > ctx:
        raise InvalidArgument(f"prompt ({len(prompt)}) + max_new_tokens ({max_new}) exceeds the "
                              f"context {ctx}")
    for name in ("committed_token_ids", "prediction_token_ids"):
        if len(getattr(req, name)) > ctx:  # (committed: below max_new_tokens, GenerateParams)
            raise InvalidArgument(f"{name} has {len(getattr(req, name))} ids, more than the "
                                  f"context {ctx}")
    v = info.vocab_size
    for name, ids in (("prompt_token_ids", req.prompt_token_ids),
                      ("committed_token_ids", req.committed_token_ids),
                      ("prediction_token_ids", req.prediction_token_ids),
                      ("stop_token_ids", stops)):
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise InvalidArgument(f"{name} has ids outside the vocabulary [0, {v}): {bad[:5]}")


def params_from_proto(req: verify_pb2.GenerateRequest, info: common_pb2.WorkerInfo,
                      default_method: Method,
                      tree_methods: frozenset[Method] = MEDUSA_TREES
                      ) -> GenerateParams:
    """Validates a request against the model's limits; InvalidArgument says what is wrong."""
    _check_sizes(req, info)
    sampling = SamplingParams.from_wire(req.sampling)
    bad = [t for t in sampling.token_ids() if t >= info.vocab_size]
    if bad:
        raise InvalidArgument(f"sampling controls name ids outside the vocabulary "
                              f"[0, {info.vocab_size}): {bad[:5]}")
    spec = req.speculation
    method = Method.from_wire(spec.method)
    if method is Method.UNSPECIFIED:
        method = default_method
    if spec.num_speculative_tokens > info.max_spec_tokens:
        raise InvalidArgument(f"num_speculative_tokens {spec.num_speculative_tokens} exceeds "
                         f"{info.max_spec_tokens}")
    typical = spec.HasField("typical_acceptance")
    auto_draft = (Method.from_wire(spec.auto_draft_method)
                  if spec.auto_draft_method != Method.UNSPECIFIED else None)
    method, auto_draft, prediction = _with_prediction(
        method, auto_draft, tuple(req.prediction_token_ids), typical)
    return GenerateParams(
        session_id=req.session_id, prompt=tuple(req.prompt_token_ids),
        committed=tuple(req.committed_token_ids), sampling=sampling,
        max_new_tokens=req.stopping.max_new_tokens,
        stop_token_ids=frozenset(req.stopping.stop_token_ids), method=method,
        num_speculative_tokens=spec.num_speculative_tokens, draft_address=spec.draft_address,
        tenant=spec.tenant, typical=(
            (spec.typical_acceptance.posterior_threshold, spec.typical_acceptance.posterior_alpha)
            if typical else None),
        logprobs=req.top_logprobs if req.logprobs else None,
        tree=_tree(spec.draft_shape, method, tree_methods), grammar=_grammar(req),
        auto_draft=auto_draft, prediction=prediction)


def _with_prediction(method: Method, auto_draft: Method | None, prediction: tuple[int, ...],
                     typical: bool) -> tuple[Method, Method | None, tuple[int, ...]]:
    """(method, auto_draft, prediction) of a session with a prediction. none, ngram, suffix and
    auto draft it in the verifier beside their own proposals (verify_service/drafts/history.py).
    A model method prefers the prediction where it matches: draft_model and eagle run as auto
    linked to their worker (asked only while no free proposal matches), medusa as auto (its
    heads likewise); mtp, layer_skip and lossy typical acceptance ignore the prediction."""
    if not prediction or method in (Method.NONE, Method.NGRAM, Method.SUFFIX, Method.AUTO):
        return method, auto_draft, prediction
    if method in AUTO_DRAFT_METHODS:
        return Method.AUTO, method, prediction
    if method is Method.MEDUSA and not typical:
        return Method.AUTO, None, prediction
    return method, auto_draft, ()


def _grammar(req: verify_pb2.GenerateRequest) -> GrammarSpec | None:
    return GrammarSpec.from_wire(req.grammar if req.HasField("grammar") else None)


def _tree(shape: int, method: Method, tree_methods: frozenset[Method]) -> bool:
    """Whether the session drafts token trees: as asked, else the server's default for the
    method (VerifierConfig.tree_methods)."""
    if shape == verify_pb2.DRAFT_SHAPE_UNSPECIFIED:
        return method in tree_methods
    if shape not in (verify_pb2.DRAFT_SHAPE_CHAIN, verify_pb2.DRAFT_SHAPE_TREE):
        raise InvalidArgument(f"unknown draft_shape {shape}")
    return shape == verify_pb2.DRAFT_SHAPE_TREE


def output_to_proto(out: RoundOutput) -> verify_pb2.GenerateResponse:
    return verify_pb2.GenerateResponse(
        token_ids=out.token_ids, num_committed=out.num_committed,
        round=verify_pb2.RoundStats(
            drafted=out.drafted, accepted=out.accepted, bonus=out.bonus,
            draft_wait_ms=out.draft_wait_ms, verify_ms=out.verify_ms,
            rejection_ms=out.rejection_ms),
        totals=verify_pb2.SessionStats(rounds=out.rounds, drafted_tokens=out.drafted_total,
                                       accepted_tokens=out.accepted_total, lossy=out.lossy,
                                       accepted_prediction_tokens=out.prediction_accepted,
                                       rejected_prediction_tokens=out.prediction_rejected),
        finish_reason=_FINISH[out.finish_reason],
        logprobs=[verify_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top]) for lp in out.logprobs])


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, engine: Engine, info: common_pb2.WorkerInfo, default_method: Method,
                 metrics: VerifierMetrics | None = None,
                 tree_methods: frozenset[Method] = MEDUSA_TREES,
                 grammars: LazyCompiler | None = None):
        self.engine, self.info, self.default_method = engine, info, default_method
        self.grammars = grammars  # None: structured output is refused
        self.tree_methods = tree_methods
        self.metrics = metrics
        self.tracer = telemetry.tracer("verifier")
        self.draining = False

    async def Generate(self, request, context):
        if self.draining:
            raise Unavailable("verifier is draining")
        # A child of the gRPC server span (OpenTelemetry's interceptor continues the caller's
        # trace); it carries what no library knows: one event per speculation round.
        span = self.tracer.start_span(telemetry.SPAN_VERIFY)
        span.set_attributes({telemetry.ATTR_SESSION: request.session_id,
                             telemetry.GEN_AI_REQUEST_MODEL: self.info.model_id,
                             telemetry.GEN_AI_REQUEST_MAX_TOKENS: request.stopping.max_new_tokens,
                             telemetry.GEN_AI_REQUEST_TEMPERATURE: request.sampling.temperature,
                             telemetry.GEN_AI_USAGE_INPUT: len(request.prompt_token_ids)})
        try:
            params = params_from_proto(request, self.info, self.default_method,
                                       self.tree_methods)
            params = dataclasses.replace(params, trace_context=tracing.inject(span))
            queue = self.engine.submit(params, await self._grammar_state(params))
        except Exception as exc:  # the interceptor picks the status code from its type
            span.set_status(trace.StatusCode.ERROR, str(exc))
            span.end()
            raise
        start, generated = time.perf_counter(), 0
        try:
            while True:
                out = await queue.get()
                if out.finish_reason in ("error", "fault"):  # this session alone failed:
                    span.set_attribute(telemetry.GEN_AI_FINISH_REASONS, [out.finish_reason])
                    if out.finish_reason == "fault":  # here: a 500, not replayed elsewhere
                        raise SessionFailed(out.error or "verification failed")
                    raise InvalidArgument(out.error or "generation failed")  # its input: 400
                if not generated and out.token_ids:
                    ttft_ms = (time.perf_counter() - start) * 1e3
                    span.set_attribute(telemetry.ATTR_TTFT_MS, ttft_ms)
                    if self.metrics is not None:
                        self.metrics.ttft.observe(ttft_ms / 1e3)
                generated += len(out.token_ids)
                span.add_event(telemetry.EVENT_ROUND, {
                    telemetry.ATTR_DRAFTED: out.drafted, telemetry.ATTR_ACCEPTED: out.accepted,
                    telemetry.ATTR_DRAFT_WAIT_MS: out.draft_wait_ms,
                    telemetry.ATTR_VERIFY_MS: out.verify_ms,
                    telemetry.ATTR_REJECTION_MS: out.rejection_ms})
                yield output_to_proto(out)
                if out.finish_reason is not None:
                    span.set_attribute(telemetry.GEN_AI_FINISH_REASONS, [out.finish_reason])
                    return
        finally:
            span.set_attribute(telemetry.GEN_AI_USAGE_OUTPUT, generated)
            span.end()
            self.engine.abort(params.session_id)  # no-op once finished; frees on cancel

    async def _grammar_state(self, params: GenerateParams):
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise InvalidArgument("grammar: this verifier does not serve structured output")
        return await self.grammars.state(params.grammar, params.committed)

    async def Info(self, request, context):
        return self.info
