"""Data: a byte-level BPE tokenizer and packed, memory-mapped token shards split by file."""

from .corpus import Document, default_sources, find_documents, split_by_file
from .shards import TokenShards

__all__ = ["Document", "TokenShards", "default_sources", "find_documents", "split_by_file"]
