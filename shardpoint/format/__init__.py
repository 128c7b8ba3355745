"""The on-disk contract: the JSON manifest, per-rank chunk indexes and the safe value codec. See docs/format.md."""

from .index import ChunkIndex, encode_index, index_digest
from .manifest import (
    DTYPE_SIZES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    READ_VERSIONS,
    ChunkMeta,
    Manifest,
    RankFiles,
    TensorMeta,
    check_file_name,
)
from .values import decode_value, encode_value

__all__ = [
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "READ_VERSIONS",
    "ChunkIndex",
    "ChunkMeta",
    "Manifest",
    "RankFiles",
    "TensorMeta",
    "check_file_name",
    "decode_value",
    "encode_value",
    "encode_index",
    "index_digest",
]
