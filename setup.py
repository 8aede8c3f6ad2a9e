"""Build glue that pyproject.toml cannot express: the optional liburing extension.

`native/build_uring.py` describes a cffi (API mode) extension, `fuyoud._uring`. Where
liburing or a compiler is missing the build of that one extension is skipped with a
warning, the install succeeds, and the daemon falls back to its thread-pool engine.
"""
from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "no io_uring"
            self.warn(f"fuyoud._uring not built ({exc}); fuyoud will use the thread-pool I/O engine")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"{ext.name} not built ({exc}); fuyoud will use the thread-pool I/O engine")


setup(
    cmdclass={"build_ext": OptionalBuildExt},
    cffi_modules=["native/build_uring.py:ffibuilder"],
)
