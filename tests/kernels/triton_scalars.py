"""Give Triton's interpreter the scalar argument types of the compiled launcher (tests/ is not a
package: import as `from triton_scalars import compiled_scalar_types`).

On a GPU a plain Python float passed to a `@triton.jit` kernel becomes a float32 argument (the
launcher types it with `mangle_type`, which says "fp32" for every float), while
TRITON_INTERPRET=1 hands the Python float itself to the kernel body, where it behaves like a
float64. A kernel that takes a float64 factor as a Python float is therefore exact under the
interpreter and silently rounds the factor to float32 on the GPU. With this patch the
interpreter rounds such an argument the way the launcher types it, so the CPU tests see the
GPU's arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def compiled_scalar_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the interpreter pass Python float kernel arguments with the launcher's type."""
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import mangle_type

    original = interpreter._implicit_cvt
    np_types = {"fp32": np.float32, "fp64": np.float64}

    def convert(arg: Any) -> Any:
        if isinstance(arg, float):
            name = mangle_type(arg)  # what the compiled launcher makes of it
            ty = tl.str_to_ty(name, None)
            handle = interpreter.TensorHandle(np.array([arg], dtype=np_types[name]), ty)
            return tl.tensor(handle, ty)
        return original(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", convert)
