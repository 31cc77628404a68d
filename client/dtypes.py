"""torch dtypes and their names on the wire."""

from __future__ import annotations

import torch

from weightwire.protocol.errors import ErrorCode, RegistrationError
from weightwire.protocol.tensors import DType

TORCH: dict[DType, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
NAME: dict[torch.dtype, DType] = {v: k for k, v in TORCH.items()}


def name_of(dtype: torch.dtype) -> DType:
    try:
        return NAME[dtype]
    except KeyError:
        raise RegistrationError(
            f"dtype {dtype} is not supported (supported: {', '.join(TORCH)})",
            code=ErrorCode.DTYPE_MISMATCH,
        ) from None
