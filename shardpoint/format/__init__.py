"""Internal: the on-disk contract: the JSON manifest, per-rank chunk indexes, the data-file layout and the safe value codec.

See docs/format.md.
"""

from .datafile import ALIGN, DEFAULT_BLOCK_SIZE, DataFileWriter, block_checksums, verify_blocks
from .index import ChunkIndex, encode_index, fqn_key, index_digest
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
    seal,
    unseal,
)
from .strict import Limits, strict_loads
from .values import check_optimizer_doc, decode_value, encode_value

__all__ = [
    "ALIGN",
    "DEFAULT_BLOCK_SIZE",
    "DataFileWriter",
    "block_checksums",
    "verify_blocks",
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
    "check_optimizer_doc",
    "fqn_key",
    "Limits",
    "seal",
    "strict_loads",
    "unseal",
    "decode_value",
    "encode_value",
    "encode_index",
    "index_digest",
]
