"""Generated gRPC code for proto/fuyou.proto (package ``fuyou.v1``).

Regenerate with ``python -m fuyou_proto.generate`` after editing the .proto.
"""
from fuyou_proto import fuyou_pb2 as pb  # noqa: F401
from fuyou_proto import fuyou_pb2_grpc as rpc  # noqa: F401

SESSION_METADATA_KEY = "x-fuyou-session"
ADMIN_METADATA_KEY = "x-fuyou-admin"


def dtype_name(value: int) -> str:
    """A DType as torch names it ("float32", "bfloat16", "float16"); ValueError for
    DTYPE_UNSPECIFIED or a value this version does not know."""
    if value == pb.DTYPE_UNSPECIFIED or value not in pb.DType.values():
        raise ValueError(f"dtype {value} is not one of FLOAT32, BFLOAT16, FLOAT16")
    return pb.DType.Name(value).lower()


def dtype_value(name: str) -> int:
    return pb.DType.Value(name.upper())


def state_dtype_name(value: int) -> str:
    """A StateDType as fuyou names it ("fp32", "bf16", "int8"); ValueError if unknown."""
    if value not in pb.StateDType.values():
        raise ValueError(f"state dtype {value} is not one of STATE_FP32, STATE_BF16, STATE_INT8")
    return pb.StateDType.Name(value).removeprefix("STATE_").lower()


def state_dtype_value(name: str) -> int:
    return pb.StateDType.Value("STATE_" + name.upper())
