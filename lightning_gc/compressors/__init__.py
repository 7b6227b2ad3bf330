"""Gradient compressors: pure tensor transforms with typed configs, one algorithm per module."""

from .base import Compressed, Compressor, GroupContext, ratio_to_k
from .registry import (
    COMPRESSORS,
    CompressorEntry,
    available_compressors,
    build_compressor,
    build_config,
    get_entry,
    register_compressor,
    takes_ratio,
)

__all__ = [
    "COMPRESSORS",
    "Compressed",
    "Compressor",
    "CompressorEntry",
    "GroupContext",
    "available_compressors",
    "build_compressor",
    "build_config",
    "get_entry",
    "ratio_to_k",
    "register_compressor",
    "takes_ratio",
]
