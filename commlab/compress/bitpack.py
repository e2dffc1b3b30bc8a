"""Packing small codes into bytes, so that a 1-bit or 4-bit code really costs 1 or 4 bits on the wire.

:func:`pack_bits` puts 8 one-bit values in a byte (element ``8i + j`` in bit ``j``, least significant
first, as ``numpy.packbits(..., bitorder="little")``); :func:`pack_nibbles` puts 2 four-bit values in a
byte (element ``2i`` in the low nibble). The last byte is zero-padded, and the unpacking side is told the
element count. Any shape and layout in (read row-major), 1-D tensors out, on the input's device.
Unpacking goes through a 256-row table (:func:`bit_table`, :func:`nibble_table`, :func:`decode_bytes`) that
a compressor maps to its decoded values, so a byte becomes its floats in one gather; packing reads 8 (or
4) codes as one little-endian word (a plain weighted sum on a big-endian host).
``python -m commlab bench --compressors`` measures the codecs.

Book: chapter 6, §6.2 and §6.4 (INT4 and sign at their true size; the source article stores a 4-bit code
in a whole byte).
"""

from __future__ import annotations

import sys

import torch

from commlab import checks

__all__ = ["pack_bits", "pack_bits_", "unpack_bits", "pack_nibbles", "unpack_nibbles", "packed_bits_nbytes",
           "packed_nibbles_nbytes", "bit_table", "nibble_table", "decode_bytes"]

# Bit j of a byte has weight 2**j (LSB first).
_BIT_WEIGHTS = [1 << j for j in range(8)]
_LITTLE_ENDIAN = sys.byteorder == "little"
# Eight 0/1 bytes read as a little-endian int64 hold input j at bit 8j. Byte k of this constant is 2**(7-k), so
# the product puts input j at bit 8j + 8k + 7 - k; for k = 7 - j that is bit 56 + j, the top byte. Every term
# lands on a bit of its own (nothing carries), and those beyond bit 63 fall off the 64-bit product.
_GATHER_BITS = 0x0102040810204080


def packed_bits_nbytes(numel: int) -> int:
    """Bytes :func:`pack_bits` produces for ``numel`` one-bit values: ``ceil(numel / 8)``."""
    return -(-numel // 8)


def packed_nibbles_nbytes(numel: int) -> int:
    """Bytes :func:`pack_nibbles` produces for ``numel`` four-bit values: ``ceil(numel / 2)``."""
    return -(-numel // 2)


def _flat_codes(values: torch.Tensor, what: str, high: int, check: bool) -> torch.Tensor:
    """``values`` as a flat bool or uint8 tensor, after checking (if ``check``) that every value lies in 0..high."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(values).__name__}")
    if values.is_floating_point() or values.is_complex():
        raise TypeError(f"{what} expects a bool or integer tensor with values 0..{high}, got dtype {values.dtype}; "
                        "convert the codes to an integer dtype first (rounding is the caller's decision)")
    flat = values.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if check and flat.numel():
        lo, hi = (int(v) for v in torch.aminmax(flat))
        if lo < 0 or hi > high:
            raise ValueError(f"{what} needs values in 0..{high}; got values from {lo} to {hi} "
                             f"({int(((flat < 0) | (flat > high)).sum())} of {flat.numel()} out of range)")
    return flat.to(torch.uint8)


def _words(head: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D uint8 tensor read as little-endian words of ``dtype`` (a copy only if its offset is not aligned)."""
    if head.storage_offset() % torch.empty((), dtype=dtype).element_size() or not head.is_contiguous():
        head = head.clone(memory_format=torch.contiguous_format)
    return head.view(dtype)


def _weights(count: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_WEIGHTS[:count], dtype=torch.uint8, device=device)


def pack_bits(values: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Pack one-bit values, 8 per byte.

    Args:
        values: bool tensor, or an integer tensor whose values are all 0 or 1; any shape and layout.
        check: verify the values of an integer tensor (one pass over them); ``False`` is for callers that
            produced the codes themselves (a bool tensor needs no check).

    Returns:
        uint8 tensor of ``ceil(numel / 8)`` bytes; element ``8*i + j`` is bit ``j`` (LSB first) of byte
        ``i``; unused high bits of the last byte are 0.

    Raises:
        TypeError: a floating-point or complex tensor.
        ValueError: an integer value other than 0 or 1 (with ``check``; without it the bytes are undefined).
    """
    return _pack_bits(_flat_codes(values, "pack_bits", 1, check), scratch=False)


def pack_bits_(values: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` of a contiguous bool tensor that the caller owns and no longer needs: its memory is
    used for the intermediate words (its values are undefined afterwards), which saves an allocation of its
    size. For the compressors' own freshly computed bits.

    Raises:
        TypeError: ``values`` is not a bool tensor.
    """
    if not isinstance(values, torch.Tensor) or values.dtype != torch.bool:
        raise TypeError(f"pack_bits_ packs a bool tensor it may overwrite, got "
                        f"{values.dtype if isinstance(values, torch.Tensor) else type(values).__name__}; use pack_bits")
    return _pack_bits(values.reshape(-1).view(torch.uint8), scratch=True)


def _pack_bits(flat: torch.Tensor, scratch: bool) -> torch.Tensor:
    n, full = flat.numel(), flat.numel() // 8
    out = torch.empty(packed_bits_nbytes(n), dtype=torch.uint8, device=flat.device)
    if full:
        head = flat[:8 * full]
        if _LITTLE_ENDIAN:
            # The top byte of each product is the packed byte; the copy into uint8 keeps the low byte of the
            # shifted value (the arithmetic shift sign-extends when bit 63 is set, which only fills higher bytes).
            words = _words(head, torch.int64)
            if scratch or words.data_ptr() != head.data_ptr():  # memory of our own (or a copy): in place
                words.mul_(_GATHER_BITS)
            else:
                words = words * _GATHER_BITS
            out[:full] = words.bitwise_right_shift_(56)
        else:
            # 8 distinct powers of two times 0/1 sum to at most 255: no overflow in uint8.
            out[:full] = (head.view(-1, 8) * _weights(8, flat.device)).sum(dim=1, dtype=torch.uint8)
    if n % 8:
        out[full:] = (flat[8 * full:] * _weights(n % 8, flat.device)).sum(dtype=torch.uint8)
    return out


def _check_packed(packed: torch.Tensor, numel: int, nbytes: int, what: str) -> torch.Tensor:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"{what} expects the uint8 tensor its packing function returned, got {got}")
    checks.integer("numel", numel, least=0, where=what)
    if packed.numel() != nbytes:
        raise ValueError(f"{what}: {numel} elements are packed in {nbytes} bytes, but {packed.numel()} bytes "
                         "were given; pass the element count the tensor was packed with")
    return packed.reshape(-1)


def bit_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """``(256, 8)`` int32 table: row ``b`` holds the bits of byte ``b``, LSB first (0 or 1).

    Map it to the values the bits stand for (``table * 2 - 1`` for signs) and decode with :func:`decode_bytes`.
    """
    b = torch.arange(256, dtype=torch.int32, device=device)
    return (b[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1


def nibble_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """``(256, 2)`` int32 table: row ``b`` holds ``(b & 15, b >> 4)``, the low then the high nibble of byte ``b``."""
    b = torch.arange(256, dtype=torch.int32, device=device)
    return torch.stack([b & 15, b >> 4], dim=1)


def decode_bytes(table: torch.Tensor, packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` of ``table[packed[i], j]`` in byte order (``i`` then ``j``): 1-D, ``table``'s dtype.

    Args:
        table: ``(256, k)`` on ``packed``'s device, the k values that each byte value stands for (a mapped
            :func:`bit_table` or :func:`nibble_table`); any dtype.
        packed: uint8 bytes, ``ceil(numel / k)`` of them (checked by the callers that take user input).

    One gather (``index_select``) from bytes to values: no intermediate tensor of codes.
    """
    return table.index_select(0, packed.reshape(-1).to(torch.int32)).reshape(-1)[:numel]


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``numel`` elements.

    Raises:
        TypeError: ``packed`` is not uint8.
        ValueError: ``numel`` is negative, or ``packed`` does not hold exactly ``ceil(numel / 8)`` bytes.
    """
    flat = _check_packed(packed, numel, packed_bits_nbytes(numel) if isinstance(numel, int) else -1, "unpack_bits")
    return decode_bytes(bit_table(flat.device).bool(), flat, numel)


def pack_nibbles(values: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Pack four-bit values, 2 per byte.

    Args:
        values: integer (or bool) tensor with values in 0..15; any shape and layout.
        check: verify the values (one pass over them); ``False`` is for callers that produced the codes
            themselves.

    Returns:
        uint8 tensor of ``ceil(numel / 2)`` bytes; element ``2*i`` is the low nibble of byte ``i``,
        element ``2*i + 1`` the high nibble; for an odd count the last high nibble is 0.

    Raises:
        TypeError: a floating-point or complex tensor.
        ValueError: a value outside 0..15 (with ``check``; without it the bytes are undefined).
    """
    flat = _flat_codes(values, "pack_nibbles", 15, check)
    n = flat.numel()
    out = torch.empty(packed_nibbles_nbytes(n), dtype=torch.uint8, device=flat.device)
    done = 0
    if _LITTLE_ENDIAN and n >= 4:
        # Four nibbles n0..n3 in a little-endian int32 word w (n_k at bit 8k, all < 16, so w >= 0): w | w >> 4
        # holds n0 | n1 << 4 in byte 0 and n2 | n3 << 4 in byte 2, and the even bytes are the packed ones.
        # (int32, not int16 pairs: torch's int16 kernels are several times slower on CPU.)
        words = _words(flat[:n - n % 4], torch.int32)
        both = words >> 4
        both |= words
        out[:n // 4 * 2] = both.view(torch.uint8)[::2]
        done = n - n % 4
    if n - done >= 2:
        pairs = flat[done:n - n % 2].view(-1, 2)
        out[done // 2:n // 2] = pairs[:, 0] | (pairs[:, 1] << 4)
    if n % 2:
        out[n // 2:] = flat[n - 1:]
    return out


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: a uint8 tensor of ``numel`` values in 0..15.

    Raises:
        TypeError: ``packed`` is not uint8.
        ValueError: ``numel`` is negative, or ``packed`` does not hold exactly ``ceil(numel / 2)`` bytes.
    """
    flat = _check_packed(packed, numel, packed_nibbles_nbytes(numel) if isinstance(numel, int) else -1,
                         "unpack_nibbles")
    return decode_bytes(nibble_table(flat.device).to(torch.uint8), flat, numel)
