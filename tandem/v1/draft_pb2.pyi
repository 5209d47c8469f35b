from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_ERROR_CODE_UNSPECIFIED: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CODE_UNKNOWN_SESSION: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CODE_INVALID_ARGUMENT: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CODE_OUT_OF_SYNC: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CODE_UNSUPPORTED_METHOD: _ClassVar[DraftErrorCode]
    DRAFT_ERROR_CODE_INTERNAL: _ClassVar[DraftErrorCode]
DRAFT_ERROR_CODE_UNSPECIFIED: DraftErrorCode
DRAFT_ERROR_CODE_UNKNOWN_SESSION: DraftErrorCode
DRAFT_ERROR_CODE_INVALID_ARGUMENT: DraftErrorCode
DRAFT_ERROR_CODE_OUT_OF_SYNC: DraftErrorCode
DRAFT_ERROR_CODE_RESOURCE_EXHAUSTED: DraftErrorCode
DRAFT_ERROR_CODE_UNSUPPORTED_METHOD: DraftErrorCode
DRAFT_ERROR_CODE_INTERNAL: DraftErrorCode

class DraftControl(_message.Message):
    __slots__ = ("open", "commit", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    commit: CommitTokens
    close: CloseSession
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., commit: _Optional[_Union[CommitTokens, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "method", "max_run_ahead", "top_n", "epoch", "max_ngram_size", "trace_context", "features", "tenant", "tree", "grammar", "grammar_start")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    method: _common_pb2.SpeculationMethod
    max_run_ahead: int
    top_n: int
    epoch: int
    max_ngram_size: int
    trace_context: _containers.ScalarMap[str, str]
    features: TargetFeatures
    tenant: str
    tree: bool
    grammar: _common_pb2.Grammar
    grammar_start: int
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., method: _Optional[_Union[_common_pb2.SpeculationMethod, str]] = ..., max_run_ahead: _Optional[int] = ..., top_n: _Optional[int] = ..., epoch: _Optional[int] = ..., max_ngram_size: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., features: _Optional[_Union[TargetFeatures, _Mapping]] = ..., tenant: _Optional[str] = ..., tree: _Optional[bool] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., grammar_start: _Optional[int] = ...) -> None: ...

class TargetFeatures(_message.Message):
    __slots__ = ("start_position", "hidden_size", "data")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    hidden_size: int
    data: bytes
    def __init__(self, start_position: _Optional[int] = ..., hidden_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CommitTokens(_message.Message):
    __slots__ = ("session_id", "epoch", "start_position", "token_ids", "max_run_ahead", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_run_ahead: int
    features: TargetFeatures
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_run_ahead: _Optional[int] = ..., features: _Optional[_Union[TargetFeatures, _Mapping]] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: DraftErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[DraftErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("session_id", "epoch", "position", "token_id", "q", "error", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    position: int
    token_id: int
    q: _common_pb2.SparseDistribution
    error: DraftError
    tree: TreeNode
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., position: _Optional[int] = ..., token_id: _Optional[int] = ..., q: _Optional[_Union[_common_pb2.SparseDistribution, _Mapping]] = ..., error: _Optional[_Union[DraftError, _Mapping]] = ..., tree: _Optional[_Union[TreeNode, _Mapping]] = ...) -> None: ...

class TreeNode(_message.Message):
    __slots__ = ("parent", "path_prob", "last")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PATH_PROB_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    parent: int
    path_prob: float
    last: bool
    def __init__(self, parent: _Optional[int] = ..., path_prob: _Optional[float] = ..., last: _Optional[bool] = ...) -> None: ...
