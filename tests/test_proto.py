"""The committed gRPC modules must be exactly what proto/fuyou.proto generates."""
from pathlib import Path

from fuyou_proto import generate

PROTO_DIR = Path(generate.__file__).parent


def test_generated_code_is_fresh(tmp_path):
    for path in generate.generate(tmp_path):
        committed = PROTO_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m fuyou_proto.generate` and commit the result")
