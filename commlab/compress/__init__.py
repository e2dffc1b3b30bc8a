"""Layer 4: gradient compressors behind one protocol (chapters 4-7).

See :mod:`commlab.compress.base` for the protocol (``compress -> Payload``, ``decompress``, ``linear``) and
the NaN/Inf policy.
"""

from commlab.compress.base import Compressor, Payload, check_finite, compression_ratio

__all__ = ["Compressor", "Payload", "check_finite", "compression_ratio"]

from commlab.compress.bitpack import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles
from commlab.compress.sparse import RandomK, TopK, topk_global
from commlab.compress.quantize import QSGD, RoundingQuantizer, qsgd_variance_bound
from commlab.compress.sign import SignCompressor
from commlab.compress.error_feedback import ErrorFeedback
from commlab.compress.two_phase import ChunkedCompressor, chunk_numel, two_phase_bytes_sent_per_rank
from commlab.compress.aggregate import (Aggregated, aggregate, expected_union_support, sparse_ring_fill_in,
                                        union_support_sizes)

__all__ += ["pack_bits", "unpack_bits", "pack_nibbles", "unpack_nibbles", "TopK", "RandomK", "topk_global",
            "QSGD", "RoundingQuantizer", "qsgd_variance_bound", "SignCompressor", "ErrorFeedback",
            "ChunkedCompressor", "chunk_numel", "two_phase_bytes_sent_per_rank",
            "Aggregated", "aggregate", "expected_union_support", "sparse_ring_fill_in", "union_support_sizes"]

from commlab.compress.cast import CastCompressor
from commlab.compress.powersgd import PowerSGDBytes, PowerSGDState, powersgd_all_reduce, powersgd_nbytes
from commlab.compress.hooks import CompressionHookState, compression_hook, powersgd_hook

__all__ += ["CastCompressor", "PowerSGDBytes", "PowerSGDState", "powersgd_all_reduce", "powersgd_nbytes",
            "CompressionHookState", "compression_hook", "powersgd_hook"]
