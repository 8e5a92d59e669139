from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockHeader(_message.Message):
    __slots__ = ("hash", "size", "crc32", "layout", "token_ids", "missing")
    HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    size: int
    crc32: int
    layout: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    missing: bool
    def __init__(self, hash: _Optional[bytes] = ..., size: _Optional[int] = ..., crc32: _Optional[int] = ..., layout: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., missing: _Optional[bool] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChunkBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[BlockChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[BlockChunk, _Mapping]]] = ...) -> None: ...

class SharedBlock(_message.Message):
    __slots__ = ("header", "offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    offset: int
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class SharedPut(_message.Message):
    __slots__ = ("segment", "blocks")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    blocks: _containers.RepeatedCompositeFieldContainer[SharedBlock]
    def __init__(self, segment: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[SharedBlock, _Mapping]]] = ...) -> None: ...

class SharedGet(_message.Message):
    __slots__ = ("request", "segment", "offset", "capacity")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    request: GetRequest
    segment: str
    offset: int
    capacity: int
    def __init__(self, request: _Optional[_Union[GetRequest, _Mapping]] = ..., segment: _Optional[str] = ..., offset: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class SharedBlocks(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[SharedBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[SharedBlock, _Mapping]]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("stored", "already_held", "rejected")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_HELD_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_held: int
    rejected: int
    def __init__(self, stored: _Optional[int] = ..., already_held: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("hashes", "lease_holder", "lease_seconds")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_holder: str
    lease_seconds: float
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., lease_holder: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContainsReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("hashes", "lease_holder")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_holder: str
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., lease_holder: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("blocks_held", "capacity_blocks", "blocks_evicted", "bytes_in", "bytes_out", "host_tier_blocks", "host_tier_capacity_blocks", "blocks_demoted", "blocks_promoted", "blocks_rejected", "blocks_leased", "slot_bytes", "device")
    BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LEASED_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    blocks_held: int
    capacity_blocks: int
    blocks_evicted: int
    bytes_in: int
    bytes_out: int
    host_tier_blocks: int
    host_tier_capacity_blocks: int
    blocks_demoted: int
    blocks_promoted: int
    blocks_rejected: int
    blocks_leased: int
    slot_bytes: int
    device: str
    def __init__(self, blocks_held: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., blocks_evicted: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_capacity_blocks: _Optional[int] = ..., blocks_demoted: _Optional[int] = ..., blocks_promoted: _Optional[int] = ..., blocks_rejected: _Optional[int] = ..., blocks_leased: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "include_stop_str_in_output", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    prompt_logprobs: int
    include_stop_str_in_output: bool
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("hash", "node")
    HASH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    node: str
    def __init__(self, hash: _Optional[bytes] = ..., node: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TailKV(_message.Message):
    __slots__ = ("num_tokens", "data", "dtype")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    data: bytes
    dtype: str
    def __init__(self, num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., dtype: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "num_cached_blocks", "cache_salt", "cached_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_cached_blocks: int
    cache_salt: str
    cached_blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_cached_blocks: _Optional[int] = ..., cache_salt: _Optional[str] = ..., cached_blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "first_logprob", "blocks", "tail", "num_cached_tokens", "prompt_logprobs", "first_text", "finish_reason")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: TokenLogprob
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    tail: TailKV
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    first_text: str
    finish_reason: str
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., tail: _Optional[_Union[TailKV, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., first_text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("running", "waiting", "kv_cache_usage", "pending")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_cache_usage: float
    pending: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., pending: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "prefilled", "do_prefill", "cached_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    DO_PREFILL_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    prefilled: PrefillReply
    do_prefill: bool
    cached_blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., prefilled: _Optional[_Union[PrefillReply, _Mapping]] = ..., do_prefill: _Optional[bool] = ..., cached_blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
