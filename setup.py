"""Build glue that pyproject.toml cannot express: the C extensions.

`native/build_uring.py` describes `fuyoud._uring` (the io_uring engine) and
`native/build_lowp.py` `fuyoud._lowp` (the int8 optimizer-state codec), both cffi API
mode.

Whether a failed build fails the install depends on ``FUYOU_NATIVE``:

* ``require`` (what ``./run.sh`` sets once it has installed, or found, the compiler,
  liburing's headers and Python's): a failed build stops the install, naming the
  extension and the compiler's error. A host that has the toolchain must get the
  extensions; without this a broken build turned into skipped tests and a green CI.
* unset or ``optional`` (a plain ``pip install`` on a host that may lack liburing or a
  compiler): a failed build is a warning, the install succeeds, and the daemon falls
  back: to its thread-pool engine, to torch for the codec (the same bits, slower).
"""
import os

from setuptools import setup
from setuptools.command.build_ext import build_ext

MODE = os.environ.get("FUYOU_NATIVE", "optional")
if MODE not in ("optional", "require"):
    raise SystemExit(f"FUYOU_NATIVE={MODE!r}: expected 'require' or 'optional'")


class NativeBuildFailed(RuntimeError):
    """An extension did not build where the toolchain was said to be present."""


def _failed(name: str, exc: BaseException) -> NativeBuildFailed:
    return NativeBuildFailed(
        f"{name} did not build: {exc}. FUYOU_NATIVE=require (./run.sh sets it once gcc, liburing-dev and "
        f"Python's headers are installed), so this is a build failure, not a missing package: the compiler's "
        f"output is above. Set FUYOU_NATIVE=optional to install without it (fuyoud then uses its fallback).")


class NativeBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except NativeBuildFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a failure outside any one extension
            if MODE == "require":
                raise _failed("fuyoud's C extensions", exc) from exc
            self.warn(f"fuyoud's C extensions not built ({exc}); fuyoud will use its fallbacks")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            if MODE == "require":
                raise _failed(ext.name, exc) from exc
            self.warn(f"{ext.name} not built ({exc}); fuyoud will use its fallback")


setup(
    cmdclass={"build_ext": NativeBuildExt},
    cffi_modules=["native/build_uring.py:ffibuilder", "native/build_lowp.py:ffibuilder"],
)
