"""Generated gRPC code for proto/fuyou.proto (package ``fuyou.v1``).

Regenerate with ``python -m fuyou_proto.generate`` after editing the .proto.
"""
from fuyou_proto import fuyou_pb2 as pb  # noqa: F401
from fuyou_proto import fuyou_pb2_grpc as rpc  # noqa: F401

SESSION_METADATA_KEY = "x-fuyou-session"
ADMIN_METADATA_KEY = "x-fuyou-admin"
