"""Regenerate the Python gRPC code from proto/fuyou.proto.

The generated modules are committed next to the .proto so that an editable install
needs no code generation step; tests/test_proto.py fails when they are stale. Run:

    python -m fuyou_proto.generate          # rewrite proto/fuyou_proto/fuyou_pb2*.py from proto/fuyou.proto
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEC = HERE.parent / "fuyou.proto"  # proto/fuyou.proto: the one spec file, beside this package
PACKAGE = "fuyou_proto"  # the import name of this folder
OUTPUTS = ("fuyou_pb2.py", "fuyou_pb2.pyi", "fuyou_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on fuyou.proto and write the modules into ``out_dir``.

    protoc names imports after the .proto's path relative to its include root, so the
    file is staged as ``fuyou_proto/fuyou.proto`` to get package-qualified imports.
    """
    from grpc_tools import protoc
    import grpc_tools

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / PACKAGE).mkdir()
        shutil.copy(SPEC, root / PACKAGE / "fuyou.proto")
        std_include = Path(grpc_tools.__file__).parent / "_proto"
        rc = protoc.main([
            "protoc", f"-I{root}", f"-I{std_include}",
            f"--python_out={root}", f"--pyi_out={root}", f"--grpc_python_out={root}",
            f"{PACKAGE}/fuyou.proto",
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            shutil.copy(root / PACKAGE / name, out_dir / name)
            written.append(out_dir / name)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
