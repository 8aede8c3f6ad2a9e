"""Build glue that pyproject.toml cannot express: the optional C extensions.

`native/build_uring.py` describes `fuyoud._uring` (the io_uring engine) and
`native/build_lowp.py` `fuyoud._lowp` (the int8 optimizer-state codec), both cffi API
mode. Where liburing or a compiler is missing an extension's build is skipped with a
warning, the install succeeds, and the daemon falls back: to its thread-pool engine, to
torch for the codec (the same bits, slower).
"""
from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "no io_uring"
            self.warn(f"fuyoud's C extensions not built ({exc}); fuyoud will use its fallbacks")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"{ext.name} not built ({exc}); fuyoud will use its fallback")


setup(
    cmdclass={"build_ext": OptionalBuildExt},
    cffi_modules=["native/build_uring.py:ffibuilder", "native/build_lowp.py:ffibuilder"],
)
