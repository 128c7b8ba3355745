"""The on-disk contract: the JSON manifest and the safe value codec. See docs/format.md."""

from .manifest import (
    DTYPE_SIZES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ChunkMeta,
    Manifest,
    TensorMeta,
    check_file_name,
)
from .values import decode_value, encode_value

__all__ = [
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ChunkMeta",
    "Manifest",
    "TensorMeta",
    "check_file_name",
    "decode_value",
    "encode_value",
]
