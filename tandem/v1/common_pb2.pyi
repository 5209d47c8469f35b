from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculationMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_METHOD_UNSPECIFIED: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NONE: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_DRAFT_MODEL: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_NGRAM: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_EAGLE: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_SUFFIX: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_MTP: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_LAYER_SKIP: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_MEDUSA: _ClassVar[SpeculationMethod]
    SPECULATION_METHOD_AUTO: _ClassVar[SpeculationMethod]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_DRAFT: _ClassVar[WorkerRole]
    WORKER_ROLE_VERIFIER: _ClassVar[WorkerRole]
SPECULATION_METHOD_UNSPECIFIED: SpeculationMethod
SPECULATION_METHOD_NONE: SpeculationMethod
SPECULATION_METHOD_DRAFT_MODEL: SpeculationMethod
SPECULATION_METHOD_NGRAM: SpeculationMethod
SPECULATION_METHOD_EAGLE: SpeculationMethod
SPECULATION_METHOD_SUFFIX: SpeculationMethod
SPECULATION_METHOD_MTP: SpeculationMethod
SPECULATION_METHOD_LAYER_SKIP: SpeculationMethod
SPECULATION_METHOD_MEDUSA: SpeculationMethod
SPECULATION_METHOD_AUTO: SpeculationMethod
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_DRAFT: WorkerRole
WORKER_ROLE_VERIFIER: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "model_id", "tokenizer_hash", "vocab_size", "max_context_length", "max_sessions", "max_spec_tokens", "max_top_n", "methods", "version")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_N_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    model_id: str
    tokenizer_hash: str
    vocab_size: int
    max_context_length: int
    max_sessions: int
    max_spec_tokens: int
    max_top_n: int
    methods: _containers.RepeatedScalarFieldContainer[SpeculationMethod]
    version: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., model_id: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_spec_tokens: _Optional[int] = ..., max_top_n: _Optional[int] = ..., methods: _Optional[_Iterable[_Union[SpeculationMethod, str]]] = ..., version: _Optional[str] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "source")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Grammar.Kind]
        KIND_JSON_SCHEMA: _ClassVar[Grammar.Kind]
        KIND_REGEX: _ClassVar[Grammar.Kind]
        KIND_CHOICE: _ClassVar[Grammar.Kind]
        KIND_LARK: _ClassVar[Grammar.Kind]
    KIND_UNSPECIFIED: Grammar.Kind
    KIND_JSON_SCHEMA: Grammar.Kind
    KIND_REGEX: Grammar.Kind
    KIND_CHOICE: Grammar.Kind
    KIND_LARK: Grammar.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: Grammar.Kind
    source: str
    def __init__(self, kind: _Optional[_Union[Grammar.Kind, str]] = ..., source: _Optional[str] = ...) -> None: ...
