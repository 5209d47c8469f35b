from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftShape(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SHAPE_UNSPECIFIED: _ClassVar[DraftShape]
    DRAFT_SHAPE_CHAIN: _ClassVar[DraftShape]
    DRAFT_SHAPE_TREE: _ClassVar[DraftShape]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
DRAFT_SHAPE_UNSPECIFIED: DraftShape
DRAFT_SHAPE_CHAIN: DraftShape
DRAFT_SHAPE_TREE: DraftShape
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SpeculationConfig(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "draft_address", "tenant", "typical_acceptance", "draft_shape", "auto_draft_method")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    AUTO_DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    method: _common_pb2.SpeculationMethod
    num_speculative_tokens: int
    draft_address: str
    tenant: str
    typical_acceptance: TypicalAcceptance
    draft_shape: DraftShape
    auto_draft_method: _common_pb2.SpeculationMethod
    def __init__(self, method: _Optional[_Union[_common_pb2.SpeculationMethod, str]] = ..., num_speculative_tokens: _Optional[int] = ..., draft_address: _Optional[str] = ..., tenant: _Optional[str] = ..., typical_acceptance: _Optional[_Union[TypicalAcceptance, _Mapping]] = ..., draft_shape: _Optional[_Union[DraftShape, str]] = ..., auto_draft_method: _Optional[_Union[_common_pb2.SpeculationMethod, str]] = ...) -> None: ...

class TypicalAcceptance(_message.Message):
    __slots__ = ("posterior_threshold", "posterior_alpha")
    POSTERIOR_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_ALPHA_FIELD_NUMBER: _ClassVar[int]
    posterior_threshold: float
    posterior_alpha: float
    def __init__(self, posterior_threshold: _Optional[float] = ..., posterior_alpha: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "committed_token_ids", "sampling", "stopping", "speculation", "logprobs", "top_logprobs", "grammar", "prediction_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stopping: StoppingCriteria
    speculation: SpeculationConfig
    logprobs: bool
    top_logprobs: int
    grammar: _common_pb2.Grammar
    prediction_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationConfig, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., prediction_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("drafted", "accepted", "bonus", "draft_wait_ms", "verify_ms", "rejection_ms")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    REJECTION_MS_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    accepted: int
    bonus: bool
    draft_wait_ms: float
    verify_ms: float
    rejection_ms: float
    def __init__(self, drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., bonus: _Optional[bool] = ..., draft_wait_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., rejection_ms: _Optional[float] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("rounds", "drafted_tokens", "accepted_tokens", "lossy", "accepted_prediction_tokens", "rejected_prediction_tokens")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    lossy: bool
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., lossy: _Optional[bool] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "num_committed", "round", "totals", "finish_reason", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_committed: int
    round: RoundStats
    totals: SessionStats
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_committed: _Optional[int] = ..., round: _Optional[_Union[RoundStats, _Mapping]] = ..., totals: _Optional[_Union[SessionStats, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
