"""cffi (API mode) builder for ``fuyoud._uring``, the io_uring shim in native/fy_uring.c.

From setup.py (run from the repository root)::

    cffi_modules=["native/build_uring.py:ffibuilder"]

For development, ``python native/build_uring.py`` (from any directory) compiles the
module and puts it into ``fuyoud/`` in place.

API-mode calls release the GIL, which UringEngine relies on: do not change that.
"""
import os
import re

from cffi import FFI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "native", "fy_uring.h")


def make_ffibuilder(root: str) -> FFI:
    """A builder whose C source paths start with ``root``."""
    with open(HEADER) as f:
        # The header marks the declarations meant for cffi, so they are written once.
        cdef = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", f.read(), re.S).group(1)
    builder = FFI()
    builder.cdef(cdef)
    builder.set_source(
        "fuyoud._uring",
        '#include "fy_uring.h"',
        sources=[os.path.join(root, "native", "fy_uring.c")],
        include_dirs=[os.path.join(root, "native")],
        libraries=["uring"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    )
    return builder


# setuptools wants source paths relative to setup.py, which runs from the repository
# root; from there this is "native/fy_uring.c".
ffibuilder = make_ffibuilder(os.path.relpath(ROOT))


if __name__ == "__main__":
    import shutil
    import tempfile

    # Absolute sources, so the objects land in the scratch directory, not in the tree.
    with tempfile.TemporaryDirectory() as tmp:
        built = make_ffibuilder(ROOT).compile(tmpdir=tmp, verbose=False)
        dest = os.path.join(ROOT, "fuyoud", os.path.basename(built))
        # Copy then rename: overwriting a loaded .so in place can crash its users.
        shutil.copyfile(built, dest + ".tmp")
        os.replace(dest + ".tmp", dest)
    print(dest)
