"""The element types mpidist sends, backend-neutral: one table, and the error for any other dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

try:  # bfloat16 for numpy comes from ml_dtypes (a dependency)
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    _ml_dtypes = None

__all__ = ["DtypeInfo", "DTYPES", "BFLOAT16", "describe", "dtype_info"]

#: numpy's bfloat16 (from ml_dtypes), or None without it
BFLOAT16: np.dtype | None = None if _ml_dtypes is None else np.dtype(_ml_dtypes.bfloat16)


class DtypeInfo:
    """What mpidist knows about one supported element type, backend-neutral."""

    __slots__ = ("dtype", "kind", "name")

    def __init__(self, dtype: np.dtype, kind: str) -> None:
        self.dtype = dtype
        self.kind = kind  # 'b' bool, 'i' signed, 'u' unsigned, 'f' floating, 'c' complex
        self.name = dtype.name

    def __repr__(self) -> str:
        return f"DtypeInfo({self.name}, kind={self.kind!r})"


def _supported() -> dict[np.dtype, DtypeInfo]:
    kinds = {
        np.bool_: "b",
        np.int8: "i", np.int16: "i", np.int32: "i", np.int64: "i",
        np.uint8: "u", np.uint16: "u", np.uint32: "u", np.uint64: "u",
        np.float16: "f", np.float32: "f", np.float64: "f",
        np.complex64: "c", np.complex128: "c",
    }  # fmt: skip
    table = {np.dtype(t): DtypeInfo(np.dtype(t), k) for t, k in kinds.items()}
    if BFLOAT16 is not None:
        table[BFLOAT16] = DtypeInfo(BFLOAT16, "f")
    return table


#: The supported element types (constant after import).
DTYPES: dict[np.dtype, DtypeInfo] = _supported()
#: numpy's ``__array_interface__`` type string of each supported dtype (``dtype.str`` costs 0.1 us a call)
TYPESTR: dict[np.dtype, str] = {d: d.str for d in DTYPES}


def describe(x: Any) -> str:
    """Return a short description such as ``float64[4, 2]`` for messages and traces."""
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is None or shape is None:
        return type(x).__name__
    return f"{getattr(dtype, 'name', dtype)}[{', '.join(str(int(s)) for s in shape)}]"


def dtype_info(dtype: np.dtype, fn: str, arg: str) -> DtypeInfo:
    """Return the DtypeInfo of ``dtype`` or raise a TypeError that says why it is unsupported."""
    info = DTYPES.get(dtype)
    if info is not None:
        return info
    if dtype.byteorder not in "=|" and dtype.newbyteorder("=") in DTYPES:
        raise TypeError(
            f"{fn}: {arg} has non-native byte order ({dtype.str}); convert it with "
            "arr.astype(arr.dtype.newbyteorder('='))"
        )
    names = ", ".join(sorted(i.name for i in DTYPES.values()))
    what = "object" if dtype.kind == "O" else ("structured" if dtype.fields else dtype.name)
    raise TypeError(f"{fn}: {arg} has dtype {what}, which mpidist does not send; supported: {names}")
