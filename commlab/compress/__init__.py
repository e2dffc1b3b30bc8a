"""Layer 4: gradient compressors behind one protocol (chapters 4-7).

See :mod:`commlab.compress.base` for the protocol (``compress -> Payload``, ``decompress``, ``linear``) and
the NaN/Inf policy.
"""

from commlab.compress.base import Compressor, Payload, check_finite, compression_ratio

__all__ = ["Compressor", "Payload", "check_finite", "compression_ratio"]
