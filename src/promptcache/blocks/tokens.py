"""Request token ids: fast validation into a compact little-endian uint32 array.

``hashing.validate_tokens`` is exact but walks every token in Python; a 128K-token
prompt would spend ~30 ms there. This module validates numpy arrays with vector
operations and plain lists of ints through ``array('I')`` (C speed), and falls
back to ``validate_tokens`` for anything unusual, which also words the errors.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from ..hashing import MAX_TOKEN_ID, validate_tokens

_U4 = np.dtype("<u4")


class RequestTokens:
    """Validated token ids: ``arr`` (uint32 array, hashing input) and ``buf`` (its bytes,
    compared against the packed tokens a block keeps)."""

    __slots__ = ("arr", "buf", "n")

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.buf = arr.tobytes()
        self.n = int(arr.shape[0])

    def slice_bytes(self, start: int, end: int) -> bytes:
        return self.buf[start * 4 : end * 4]


def to_request_tokens(tokens: Any, *, allow_empty: bool = False) -> RequestTokens:
    """Validate ``tokens`` (sequence of ints or 1-D integer array); ValueError if bad."""
    if isinstance(tokens, RequestTokens):
        return tokens
    arr: np.ndarray | None = None
    if isinstance(tokens, np.ndarray):
        if tokens.ndim == 1 and np.issubdtype(tokens.dtype, np.integer) and tokens.size:
            if tokens.dtype == _U4:
                arr = tokens
            elif int(tokens.min()) >= 0 and int(tokens.max()) <= MAX_TOKEN_ID:
                arr = tokens.astype(_U4)
    elif isinstance(tokens, (list, tuple)) and tokens:
        if set(map(type, tokens)) == {int}:
            try:
                arr = np.frombuffer(array("I", tokens), dtype=np.uintc).astype(_U4)
            except OverflowError:
                arr = None
    elif isinstance(tokens, array) and tokens.typecode in "BHILQbhilq" and tokens:
        arr = to_request_tokens(np.frombuffer(tokens, dtype=tokens.typecode)).arr
    if arr is None:
        arr = np.asarray(validate_tokens(tokens, allow_empty=allow_empty), dtype=_U4)
    return RequestTokens(np.ascontiguousarray(arr))
