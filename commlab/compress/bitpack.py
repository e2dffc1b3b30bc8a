"""Packing small codes into bytes, so that a 1-bit or 4-bit code really costs 1 or 4 bits on the wire.

The source article's INT4 quantizer keeps each 4-bit code in a whole ``int8`` (8 bits: no saving over
INT8 at all), and its sign compressor would send one byte per sign. Here the codes are packed:

* :func:`pack_bits`: 8 one-bit values per byte. Element ``8*i + j`` goes to bit ``j`` of byte ``i``,
  least significant bit first (the order of ``numpy.packbits(..., bitorder="little")``).
* :func:`pack_nibbles`: 2 four-bit values per byte. Element ``2*i`` goes to the low nibble (bits 0-3)
  of byte ``i``, element ``2*i + 1`` to the high nibble (bits 4-7).

Counts that do not fill the last byte are padded with zeros; the unpacking side must be told the
element count (a compressor knows it from the tensor's shape, which is not sent). All functions accept
any shape and any memory layout (the input is read in row-major order, as ``reshape(-1)`` does) and
return 1-D tensors on the input's device.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "pack_nibbles", "unpack_nibbles", "packed_bits_nbytes",
           "packed_nibbles_nbytes"]

# Bit j of a byte has weight 2**j (LSB first).
_BIT_WEIGHTS = [1 << j for j in range(8)]


def packed_bits_nbytes(numel: int) -> int:
    """Bytes :func:`pack_bits` produces for ``numel`` one-bit values: ``ceil(numel / 8)``."""
    return -(-numel // 8)


def packed_nibbles_nbytes(numel: int) -> int:
    """Bytes :func:`pack_nibbles` produces for ``numel`` four-bit values: ``ceil(numel / 2)``."""
    return -(-numel // 2)


def _flat_codes(values: torch.Tensor, what: str, high: int) -> torch.Tensor:
    """``values`` as a flat integer tensor, after checking that every value lies in 0..high."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(values).__name__}")
    if values.is_floating_point() or values.is_complex():
        raise TypeError(f"{what} expects a bool or integer tensor with values 0..{high}, got dtype {values.dtype}; "
                        "convert the codes to an integer dtype first (rounding is the caller's decision)")
    flat = values.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi > high:
            raise ValueError(f"{what} needs values in 0..{high}; got values from {lo} to {hi} "
                             f"({int(((flat < 0) | (flat > high)).sum())} of {flat.numel()} out of range)")
    return flat.to(torch.uint8)


def pack_bits(values: torch.Tensor) -> torch.Tensor:
    """Pack one-bit values, 8 per byte.

    Args:
        values: bool tensor, or an integer tensor whose values are all 0 or 1; any shape and layout.

    Returns:
        uint8 tensor of ``ceil(numel / 8)`` bytes; element ``8*i + j`` is bit ``j`` (LSB first) of byte
        ``i``; unused high bits of the last byte are 0.

    Raises:
        TypeError: a floating-point or complex tensor.
        ValueError: an integer value other than 0 or 1.
    """
    flat = _flat_codes(values, "pack_bits", 1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=flat.device)
    # Each row holds 8 distinct powers of two times 0/1, so the sum is at most 255: no overflow in uint8.
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _check_packed(packed: torch.Tensor, numel: int, nbytes: int, what: str) -> torch.Tensor:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"{what} expects the uint8 tensor its packing function returned, got {got}")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{what}: numel must be an int >= 0, got {numel!r}")
    if packed.numel() != nbytes:
        raise ValueError(f"{what}: {numel} elements are packed in {nbytes} bytes, but {packed.numel()} bytes "
                         "were given; pass the element count the tensor was packed with")
    return packed.reshape(-1)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``numel`` elements.

    Raises:
        TypeError: ``packed`` is not uint8.
        ValueError: ``numel`` is negative, or ``packed`` does not hold exactly ``ceil(numel / 8)`` bytes.
    """
    flat = _check_packed(packed, numel, packed_bits_nbytes(numel) if isinstance(numel, int) else -1, "unpack_bits")
    shifts = torch.arange(8, dtype=torch.uint8, device=flat.device)
    bits = (flat.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:numel].bool()


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Pack four-bit values, 2 per byte.

    Args:
        values: integer (or bool) tensor with values in 0..15; any shape and layout.

    Returns:
        uint8 tensor of ``ceil(numel / 2)`` bytes; element ``2*i`` is the low nibble of byte ``i``,
        element ``2*i + 1`` the high nibble; for an odd count the last high nibble is 0.

    Raises:
        TypeError: a floating-point or complex tensor.
        ValueError: a value outside 0..15.
    """
    flat = _flat_codes(values, "pack_nibbles", 15)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: a uint8 tensor of ``numel`` values in 0..15.

    Raises:
        TypeError: ``packed`` is not uint8.
        ValueError: ``numel`` is negative, or ``packed`` does not hold exactly ``ceil(numel / 2)`` bytes.
    """
    flat = _check_packed(packed, numel, packed_nibbles_nbytes(numel) if isinstance(numel, int) else -1,
                         "unpack_nibbles")
    both = torch.stack([flat & 0x0F, flat >> 4], dim=1)
    return both.reshape(-1)[:numel]
