from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class StateDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_FP32: _ClassVar[StateDType]
    STATE_BF16: _ClassVar[StateDType]
    STATE_INT8: _ClassVar[StateDType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
STATE_FP32: StateDType
STATE_BF16: StateDType
STATE_INT8: StateDType

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferRef(_message.Message):
    __slots__ = ("segment", "offset", "length", "generation")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    segment: int
    offset: int
    length: int
    generation: int
    def __init__(self, segment: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("reserved_bytes", "held_bytes")
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    reserved_bytes: int
    held_bytes: int
    def __init__(self, reserved_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ...) -> None: ...

class SwapOutItem(_message.Message):
    __slots__ = ("name", "buffer", "offset", "length", "persistent", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    buffer: BufferRef
    offset: int
    length: int
    persistent: bool
    namespace: str
    def __init__(self, name: _Optional[str] = ..., buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., persistent: _Optional[bool] = ..., namespace: _Optional[str] = ...) -> None: ...

class SwapOutRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SwapOutItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SwapOutItem, _Mapping]]] = ...) -> None: ...

class SwapOutReply(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class SwapInItem(_message.Message):
    __slots__ = ("name", "buffer", "offset", "object_offset", "length", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    OBJECT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    buffer: BufferRef
    offset: int
    object_offset: int
    length: int
    namespace: str
    def __init__(self, name: _Optional[str] = ..., buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., object_offset: _Optional[int] = ..., length: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class SwapInRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SwapInItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SwapInItem, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("names", "missing_ok", "namespace")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    missing_ok: bool
    namespace: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., missing_ok: _Optional[bool] = ..., namespace: _Optional[str] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("name", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    def __init__(self, name: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class ListObjectsRequest(_message.Message):
    __slots__ = ("prefix", "namespace")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    namespace: str
    def __init__(self, prefix: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class ListObjectsReply(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("name", "namespace", "size", "persistent", "devices", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    size: int
    persistent: bool
    devices: int
    version: int
    def __init__(self, name: _Optional[str] = ..., namespace: _Optional[str] = ..., size: _Optional[int] = ..., persistent: _Optional[bool] = ..., devices: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("kind", "beta1", "beta2", "eps", "weight_decay", "momentum", "dampening", "nesterov", "state_dtype")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    momentum: float
    dampening: float
    nesterov: bool
    state_dtype: StateDType
    def __init__(self, kind: _Optional[str] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., nesterov: _Optional[bool] = ..., state_dtype: _Optional[_Union[StateDType, str]] = ...) -> None: ...

class CreateGroupRequest(_message.Message):
    __slots__ = ("name", "optimizer", "weights", "offset", "numel", "with_state", "step")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    name: str
    optimizer: OptimizerSpec
    weights: BufferRef
    offset: int
    numel: int
    with_state: bool
    step: int
    def __init__(self, name: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., weights: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., with_state: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class GetGroupRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("name", "optimizer", "numel", "step", "state_bytes", "weights_offset", "chunked")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_FIELD_NUMBER: _ClassVar[int]
    name: str
    optimizer: OptimizerSpec
    numel: int
    step: int
    state_bytes: int
    weights_offset: int
    chunked: bool
    def __init__(self, name: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., numel: _Optional[int] = ..., step: _Optional[int] = ..., state_bytes: _Optional[int] = ..., weights_offset: _Optional[int] = ..., chunked: _Optional[bool] = ...) -> None: ...

class StepGroupRequest(_message.Message):
    __slots__ = ("name", "grads", "grads_offset", "grad_dtype", "weights_out", "weights_out_offset", "out_dtype", "lr", "grad_scale", "weights_object", "hyper", "masters", "masters_offset", "tensors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    GRADS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GRAD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OUT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_OBJECT_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    MASTERS_FIELD_NUMBER: _ClassVar[int]
    MASTERS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    grads: BufferRef
    grads_offset: int
    grad_dtype: DType
    weights_out: BufferRef
    weights_out_offset: int
    out_dtype: DType
    lr: float
    grad_scale: float
    weights_object: str
    hyper: OptimizerSpec
    masters: BufferRef
    masters_offset: int
    tensors: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., grads: _Optional[_Union[BufferRef, _Mapping]] = ..., grads_offset: _Optional[int] = ..., grad_dtype: _Optional[_Union[DType, str]] = ..., weights_out: _Optional[_Union[BufferRef, _Mapping]] = ..., weights_out_offset: _Optional[int] = ..., out_dtype: _Optional[_Union[DType, str]] = ..., lr: _Optional[float] = ..., grad_scale: _Optional[float] = ..., weights_object: _Optional[str] = ..., hyper: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., masters: _Optional[_Union[BufferRef, _Mapping]] = ..., masters_offset: _Optional[int] = ..., tensors: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("name", "out", "out_offset", "out_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    OUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    out: BufferRef
    out_offset: int
    out_dtype: DType
    def __init__(self, name: _Optional[str] = ..., out: _Optional[_Union[BufferRef, _Mapping]] = ..., out_offset: _Optional[int] = ..., out_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class FetchWeightsReply(_message.Message):
    __slots__ = ("served",)
    SERVED_FIELD_NUMBER: _ClassVar[int]
    served: bool
    def __init__(self, served: _Optional[bool] = ...) -> None: ...

class StepGroupReply(_message.Message):
    __slots__ = ("step", "read_seconds", "compute_seconds", "write_seconds", "prefetched", "cached_bytes", "masters_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MASTERS_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    read_seconds: float
    compute_seconds: float
    write_seconds: float
    prefetched: bool
    cached_bytes: int
    masters_bytes: int
    def __init__(self, step: _Optional[int] = ..., read_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., write_seconds: _Optional[float] = ..., prefetched: _Optional[bool] = ..., cached_bytes: _Optional[int] = ..., masters_bytes: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("index", "path", "capacity_bytes", "used_bytes", "available_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    path: str
    capacity_bytes: int
    used_bytes: int
    available_bytes: int
    def __init__(self, index: _Optional[int] = ..., path: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., available_bytes: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "io_engine", "io_engine_reason", "devices", "pinned_budget_bytes", "pinned_used_bytes", "sessions", "objects", "pid", "metrics_url", "session_socket", "bytes_read", "bytes_written", "draining", "read_bytes_per_second", "write_bytes_per_second", "uptime_seconds", "session_list", "session_budget_bytes", "segment_bytes", "optimizer_buffer_budget_bytes", "optimizer_buffers", "pinned_reserved_bytes", "store_outlives_daemon", "user_pinned_budget_bytes", "user_pinned_others_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IO_ENGINE_FIELD_NUMBER: _ClassVar[int]
    IO_ENGINE_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LIST_FIELD_NUMBER: _ClassVar[int]
    SESSION_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_BUFFER_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_OUTLIVES_DAEMON_FIELD_NUMBER: _ClassVar[int]
    USER_PINNED_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    USER_PINNED_OTHERS_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    io_engine: str
    io_engine_reason: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStatus]
    pinned_budget_bytes: int
    pinned_used_bytes: int
    sessions: int
    objects: int
    pid: int
    metrics_url: str
    session_socket: str
    bytes_read: int
    bytes_written: int
    draining: bool
    read_bytes_per_second: float
    write_bytes_per_second: float
    uptime_seconds: int
    session_list: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    session_budget_bytes: int
    segment_bytes: int
    optimizer_buffer_budget_bytes: int
    optimizer_buffers: int
    pinned_reserved_bytes: int
    store_outlives_daemon: bool
    user_pinned_budget_bytes: int
    user_pinned_others_bytes: int
    def __init__(self, version: _Optional[str] = ..., io_engine: _Optional[str] = ..., io_engine_reason: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., pinned_budget_bytes: _Optional[int] = ..., pinned_used_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., objects: _Optional[int] = ..., pid: _Optional[int] = ..., metrics_url: _Optional[str] = ..., session_socket: _Optional[str] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., draining: _Optional[bool] = ..., read_bytes_per_second: _Optional[float] = ..., write_bytes_per_second: _Optional[float] = ..., uptime_seconds: _Optional[int] = ..., session_list: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., session_budget_bytes: _Optional[int] = ..., segment_bytes: _Optional[int] = ..., optimizer_buffer_budget_bytes: _Optional[int] = ..., optimizer_buffers: _Optional[int] = ..., pinned_reserved_bytes: _Optional[int] = ..., store_outlives_daemon: _Optional[bool] = ..., user_pinned_budget_bytes: _Optional[int] = ..., user_pinned_others_bytes: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("iterations", "iteration_seconds", "exposed_optimizer_seconds", "activation_bytes_to_host", "activation_bytes_to_ssd")
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_OPTIMIZER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_TO_HOST_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_TO_SSD_FIELD_NUMBER: _ClassVar[int]
    iterations: int
    iteration_seconds: float
    exposed_optimizer_seconds: float
    activation_bytes_to_host: int
    activation_bytes_to_ssd: int
    def __init__(self, iterations: _Optional[int] = ..., iteration_seconds: _Optional[float] = ..., exposed_optimizer_seconds: _Optional[float] = ..., activation_bytes_to_host: _Optional[int] = ..., activation_bytes_to_ssd: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("id", "uid", "pid", "namespace", "started", "last_active", "pinned_bytes", "model_params", "groups", "step", "persistent_bytes", "reserved_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    uid: int
    pid: int
    namespace: str
    started: float
    last_active: float
    pinned_bytes: int
    model_params: int
    groups: int
    step: int
    persistent_bytes: int
    reserved_bytes: int
    def __init__(self, id: _Optional[int] = ..., uid: _Optional[int] = ..., pid: _Optional[int] = ..., namespace: _Optional[str] = ..., started: _Optional[float] = ..., last_active: _Optional[float] = ..., pinned_bytes: _Optional[int] = ..., model_params: _Optional[int] = ..., groups: _Optional[int] = ..., step: _Optional[int] = ..., persistent_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class ListSessionsReply(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("cancel",)
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    cancel: bool
    def __init__(self, cancel: _Optional[bool] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("name", "owned", "uid", "objects", "bytes", "snapshot_objects", "snapshot_bytes", "session_id", "checkpoints", "unnamed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    UNNAMED_FIELD_NUMBER: _ClassVar[int]
    name: str
    owned: bool
    uid: int
    objects: int
    bytes: int
    snapshot_objects: int
    snapshot_bytes: int
    session_id: int
    checkpoints: int
    unnamed: bool
    def __init__(self, name: _Optional[str] = ..., owned: _Optional[bool] = ..., uid: _Optional[int] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., snapshot_objects: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ..., session_id: _Optional[int] = ..., checkpoints: _Optional[int] = ..., unnamed: _Optional[bool] = ...) -> None: ...

class ListNamespacesReply(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class DeleteNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class DeleteNamespaceReply(_message.Message):
    __slots__ = ("objects", "bytes", "snapshot_objects")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: int
    bytes: int
    snapshot_objects: int
    def __init__(self, objects: _Optional[int] = ..., bytes: _Optional[int] = ..., snapshot_objects: _Optional[int] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("draining", "sessions")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    sessions: int
    def __init__(self, draining: _Optional[bool] = ..., sessions: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("session_id", "directory", "timeout_seconds", "mode", "client_state", "handed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_FIELD_NUMBER: _ClassVar[int]
    HANDED_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    directory: str
    timeout_seconds: float
    mode: str
    client_state: bytes
    handed: str
    def __init__(self, session_id: _Optional[int] = ..., directory: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., mode: _Optional[str] = ..., client_state: _Optional[bytes] = ..., handed: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("directory", "handed")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    HANDED_FIELD_NUMBER: _ClassVar[int]
    directory: str
    handed: str
    def __init__(self, directory: _Optional[str] = ..., handed: _Optional[str] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("namespace", "step", "objects", "bytes", "mode", "client_state", "seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    step: int
    objects: int
    bytes: int
    mode: str
    client_state: bytes
    seconds: float
    def __init__(self, namespace: _Optional[str] = ..., step: _Optional[int] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., mode: _Optional[str] = ..., client_state: _Optional[bytes] = ..., seconds: _Optional[float] = ...) -> None: ...

class CommitCheckpointRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("directory", "handed")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    HANDED_FIELD_NUMBER: _ClassVar[int]
    directory: str
    handed: str
    def __init__(self, directory: _Optional[str] = ..., handed: _Optional[str] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("directory", "namespace", "objects", "bytes", "step", "seconds", "mode", "manifest")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    directory: str
    namespace: str
    objects: int
    bytes: int
    step: int
    seconds: float
    mode: str
    manifest: bytes
    def __init__(self, directory: _Optional[str] = ..., namespace: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., step: _Optional[int] = ..., seconds: _Optional[float] = ..., mode: _Optional[str] = ..., manifest: _Optional[bytes] = ...) -> None: ...
