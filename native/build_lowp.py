"""cffi (API mode) builder for ``fuyoud._lowp``, the int8 codec in native/fy_lowp.c.

From setup.py (run from the repository root)::

    cffi_modules=["native/build_lowp.py:ffibuilder"]

For development, ``python native/build_lowp.py`` compiles it into ``fuyoud/`` in place.
Without it (no compiler), fuyoud/optimizer/lowp.py computes the same bits with torch,
several times slower. API-mode calls release the GIL.
"""
import os
import re

from cffi import FFI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "native", "fy_lowp.h")


def make_ffibuilder(root: str) -> FFI:
    with open(HEADER) as f:
        cdef = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", f.read(), re.S).group(1)
    builder = FFI()
    builder.cdef(cdef)
    builder.set_source(
        "fuyoud._lowp",
        '#include "fy_lowp.h"',
        sources=[os.path.join(root, "native", "fy_lowp.c")],
        include_dirs=[os.path.join(root, "native")],
        # Exact IEEE arithmetic in the stated order: no contraction into fused multiply-adds.
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-ffp-contract=off", "-fno-math-errno"],
    )
    return builder


ffibuilder = make_ffibuilder(os.path.relpath(ROOT))


if __name__ == "__main__":
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        built = make_ffibuilder(ROOT).compile(tmpdir=tmp, verbose=False)
        dest = os.path.join(ROOT, "fuyoud", os.path.basename(built))
        shutil.copyfile(built, dest + ".tmp")
        os.replace(dest + ".tmp", dest)
    print(dest)
