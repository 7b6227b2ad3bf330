"""Gradient compressors: pure tensor transforms with typed configs, one algorithm per module."""

from .base import Compressed, Compressor, GroupContext, ratio_to_k
from .registry import (
    AUTO,
    AUTO_SUMMARY,
    COMPRESSORS,
    CompressorEntry,
    available_compressors,
    build_compressor,
    build_config,
    compressor_choices,
    get_entry,
    register_compressor,
    takes_ratio,
    unknown_compressor_message,
)

__all__ = [
    "AUTO",
    "AUTO_SUMMARY",
    "COMPRESSORS",
    "Compressed",
    "Compressor",
    "CompressorEntry",
    "GroupContext",
    "available_compressors",
    "build_compressor",
    "build_config",
    "compressor_choices",
    "get_entry",
    "ratio_to_k",
    "register_compressor",
    "takes_ratio",
    "unknown_compressor_message",
]
