from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("index", "path", "capacity_bytes", "used_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    path: str
    capacity_bytes: int
    used_bytes: int
    def __init__(self, index: _Optional[int] = ..., path: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "io_engine", "io_engine_reason", "devices", "pinned_budget_bytes", "pinned_used_bytes", "sessions", "objects", "pid", "metrics_url", "session_socket")
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
    def __init__(self, version: _Optional[str] = ..., io_engine: _Optional[str] = ..., io_engine_reason: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., pinned_budget_bytes: _Optional[int] = ..., pinned_used_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., objects: _Optional[int] = ..., pid: _Optional[int] = ..., metrics_url: _Optional[str] = ..., session_socket: _Optional[str] = ...) -> None: ...
