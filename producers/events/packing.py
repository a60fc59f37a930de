"""Binary packing of token arrays inside JSON events.

Token ids travel as base64 of little-endian ``int32`` and log-probs as base64 of little-endian
``float32`` (4 bytes per token instead of ~6-20 characters of a JSON list); Postgres stores the same
raw bytes in ``bytea`` columns.

In Python they stay packed: :class:`TokenArray` / :class:`LogProbArray` hold the raw bytes and read
as an immutable sequence of Python numbers (``len``, indexing, iteration, ``==`` with any sequence,
``+`` to a tuple, ``numpy()``). Decoding an event is then one base64 decode per array, and the
projection appends the bytes to its segment as they came (a ``model.responded`` with a few hundred
tokens validates ~2x faster than as a tuple of ints, and holds 4 bytes per token instead of ~36).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import GetCoreSchemaHandler, WithJsonSchema
from pydantic_core import PydanticCustomError, core_schema


def pack_ints(values: Sequence[int] | np.ndarray) -> bytes:
    """Token ids -> raw bytes (``<i4``, 4 bytes per token)."""
    if isinstance(values, TokenArray):
        return values.raw
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_ints(raw: bytes | memoryview | None) -> np.ndarray:
    """Raw bytes -> ``int32`` array of shape ``[n]``."""
    if not raw:
        return np.zeros(0, dtype=np.int32)
    return np.frombuffer(bytes(raw), dtype="<i4").astype(np.int32)


def pack_floats(values: Sequence[float] | np.ndarray) -> bytes:
    """Log-probs -> raw bytes (``<f4``, 4 bytes per token)."""
    if isinstance(values, LogProbArray):
        return values.raw
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(raw: bytes | memoryview | None) -> np.ndarray:
    """Raw bytes -> ``float32`` array of shape ``[n]``."""
    if not raw:
        return np.zeros(0, dtype=np.float32)
    return np.frombuffer(bytes(raw), dtype="<f4").astype(np.float32)


class PackedArray(Sequence[Any]):
    """An immutable array of 4-byte little-endian numbers kept as its raw bytes (``raw``).

    Reads as a sequence of Python numbers; equal to any sequence with the same values (and to an
    array of the same class with the same bytes); hashable. Build one with :meth:`of` (values or
    another array) or :meth:`from_base64` (the wire form).
    """

    __slots__ = ("raw",)
    dtype: ClassVar[str] = ""
    """numpy dtype of the elements (set by each subclass)."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) % 4:
            raise ValueError(f"packed {self.dtype} array length {len(raw)} is not a multiple of 4")
        self.raw = bytes(raw)

    @classmethod
    def of(cls, values: Any) -> "PackedArray":
        """From a sequence of numbers (canonicalized through the wire dtype, so the decoded event
        equals the one that was sent) or an array of this class.

        Raises:
            ValueError: raw bytes (pass base64 or values), a token id outside int32, a non-number.
        """
        if isinstance(values, cls):
            return values
        if isinstance(values, (bytes, bytearray, memoryview, str)):
            raise ValueError("pass a base64 string or a sequence of numbers, not raw bytes")
        arr = np.asarray(list(values))
        if arr.size and arr.dtype.kind not in "biuf":
            raise ValueError(f"expected numbers, got {arr.dtype}")
        if arr.size and cls.dtype == "<i4":
            if arr.dtype.kind == "f" and not np.all(arr == np.floor(arr)):
                raise ValueError("token ids must be integers")
            if arr.min() < -(2**31) or arr.max() >= 2**31:
                raise ValueError("token id out of int32 range")
        return cls(arr.astype(cls.dtype).tobytes())

    @classmethod
    def from_base64(cls, text: str) -> "PackedArray":
        """From the wire form (base64 of the little-endian bytes).

        Raises:
            ValueError: not base64, or a length that is not a multiple of 4 bytes.
        """
        try:
            raw = base64.b64decode(text, validate=True)
        except ValueError as exc:  # binascii.Error is a ValueError; so is non-ASCII text
            raise ValueError(f"not base64: {exc}") from None
        return cls(raw)

    def to_base64(self) -> str:
        """The wire form."""
        return base64.b64encode(self.raw).decode("ascii")

    def numpy(self) -> np.ndarray:
        """A read-only view, shape ``[len(self)]``, dtype :attr:`dtype`."""
        return np.frombuffer(self.raw, dtype=self.dtype)

    def tolist(self) -> list[Any]:
        """The values as Python numbers."""
        values: list[Any] = self.numpy().tolist()
        return values

    def __len__(self) -> int:
        return len(self.raw) >> 2

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self.numpy()[index].tolist())
        return self.numpy()[index].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return type(other) is type(self) and other.raw == self.raw
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.dtype, self.raw))

    def __add__(self, other: Iterable[Any]) -> tuple[Any, ...]:
        return tuple(self) + tuple(other)

    def __radd__(self, other: object) -> Any:
        return type(other)(list(other) + self.tolist()) if isinstance(other, (list, tuple)) else NotImplemented

    def __repr__(self) -> str:
        values = self.tolist()
        shown = ", ".join(map(repr, values[:8])) + (", ..." if len(values) > 8 else "")
        return f"{type(self).__name__}([{shown}], n={len(values)})"

    def __reduce__(self) -> tuple[type[PackedArray], tuple[bytes]]:
        return (type(self), (self.raw,))

    @classmethod
    def _validate(cls, value: Any) -> "PackedArray":
        if isinstance(value, str):
            return cls.from_base64(value)
        return cls.of(value)

    @classmethod
    def __get_pydantic_core_schema__(cls, _source: Any, _handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        """From JSON, pydantic-core decodes the base64 (models set ``val_json_bytes="base64"``) and
        only the length check runs in Python; from Python, any of :meth:`_validate`'s inputs."""

        def validate(value: Any) -> "PackedArray":
            try:
                return cls._validate(value)
            except (ValueError, TypeError) as exc:
                raise PydanticCustomError("packed_array", "{error}", {"error": str(exc)}) from None

        return core_schema.json_or_python_schema(
            json_schema=core_schema.no_info_after_validator_function(cls, core_schema.bytes_schema()),
            python_schema=core_schema.no_info_plain_validator_function(validate),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda v: v.to_base64(), when_used="json"),
        )


class TokenArray(PackedArray):
    """Token ids: little-endian ``int32``."""

    __slots__ = ()
    dtype = "<i4"


class LogProbArray(PackedArray):
    """Per-token log-probs (natural log): little-endian ``float32``."""

    __slots__ = ()
    dtype = "<f4"


TokenIds = Annotated[
    TokenArray,
    WithJsonSchema(
        {"type": "string", "contentEncoding": "base64", "description": "little-endian int32 token ids, base64"}
    ),
]
"""Token ids: a :class:`TokenArray` in Python (built from any sequence of ints), base64 ``<i4`` on the wire."""

LogProbs = Annotated[
    LogProbArray,
    WithJsonSchema(
        {"type": "string", "contentEncoding": "base64", "description": "little-endian float32 log-probs (nats), base64"}
    ),
]
"""Per-token log-probs (nats): a :class:`LogProbArray` in Python, base64 ``<f4`` on the wire."""
