"""The committed gRPC modules must be exactly what proto/fuyou.proto generates."""
from pathlib import Path

from fuyou_proto import generate

PROTO_DIR = Path(generate.__file__).parent


def test_generated_code_is_fresh(tmp_path):
    for path in generate.generate(tmp_path):
        committed = PROTO_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m fuyou_proto.generate` and commit the result")


def test_client_and_daemon_agree_on_the_contract():
    """One table of status codes: every error the daemon raises sends one of them, and
    the client has its own exception class for each; the state layout the client sizes
    is the daemon's."""
    import fuyou_client.errors as client_errors
    import fuyoud.errors as daemon_errors
    from fuyou_client import AdamW, SGD
    from fuyou_proto.contract import ERROR_CODES
    from fuyoud.optimizer.kernels import OptimizerSpec

    sent = {cls.code.name for cls in vars(daemon_errors).values()
            if isinstance(cls, type) and issubclass(cls, daemon_errors.FuyouError)}
    assert sent <= set(ERROR_CODES)
    assert set(client_errors.BY_CODE) == set(ERROR_CODES)
    assert len(set(client_errors.BY_CODE.values())) == len(ERROR_CODES)
    for numel in (1, 1000, 4097, 10 ** 7 + 3):
        for dtype in ("fp32", "bf16", "int8"):
            assert AdamW(state_dtype=dtype).state_bytes(numel) == OptimizerSpec("adamw", state_dtype=dtype).layout(numel).size
        assert SGD(momentum=0.9).state_bytes(numel) == OptimizerSpec("sgd", momentum=0.9).layout(numel).size
        assert SGD().state_bytes(numel) == OptimizerSpec("sgd").layout(numel).size
