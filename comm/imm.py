"""The 32-bit immediate that travels with every write.

Bit layout (most significant first)::

     31    28 27                    16 15            8 7             0
    +--------+------------------------+---------------+---------------+
    |  tag   |         layer          |  micro-batch  |     slot      |
    | 4 bits |        12 bits         |    8 bits     |    8 bits     |
    +--------+------------------------+---------------+---------------+

* ``slot``: index of the receiver's slot (in the ring of this sender) that the payload was
  written into. It is chosen by the sender from the credits it holds, never by the receiver.
* ``micro-batch``: ping-pong micro-batch index (0..255).
* ``layer``: model layer index (0..4095).
* ``tag``: free for the runtime (e.g. dispatch=0 / combine=1, or the step number mod 16).

The encoding is pure and total on its domain: ``decode_imm(encode_imm(...))`` returns the
inputs, and out-of-range fields raise ``ValueError`` instead of silently wrapping.
"""

from __future__ import annotations

from dataclasses import dataclass

TAG_BITS, LAYER_BITS, MICROBATCH_BITS, SLOT_BITS = 4, 12, 8, 8
SLOT_SHIFT = 0
MICROBATCH_SHIFT = SLOT_BITS
LAYER_SHIFT = MICROBATCH_SHIFT + MICROBATCH_BITS
TAG_SHIFT = LAYER_SHIFT + LAYER_BITS
MAX_TAG = (1 << TAG_BITS) - 1
MAX_LAYER = (1 << LAYER_BITS) - 1
MAX_MICROBATCH = (1 << MICROBATCH_BITS) - 1
MAX_SLOT = (1 << SLOT_BITS) - 1
assert TAG_SHIFT + TAG_BITS == 32


@dataclass(frozen=True)
class Imm:
    """A decoded immediate."""

    layer: int
    microbatch: int
    slot: int
    tag: int = 0


def _check(name: str, value: int, maximum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
        raise ValueError(f"{name}={value!r} out of range: the immediate holds 0..{maximum}")


def encode_imm(layer: int, microbatch: int, slot: int, tag: int = 0) -> int:
    """Pack (layer, micro-batch, slot, tag) into an unsigned 32-bit integer.

    Raises ``ValueError`` if a field does not fit its bits (see the module docstring).
    """
    _check("layer", layer, MAX_LAYER)
    _check("microbatch", microbatch, MAX_MICROBATCH)
    _check("slot", slot, MAX_SLOT)
    _check("tag", tag, MAX_TAG)
    return (
        (tag << TAG_SHIFT)
        | (layer << LAYER_SHIFT)
        | (microbatch << MICROBATCH_SHIFT)
        | (slot << SLOT_SHIFT)
    )


def decode_imm(imm: int) -> Imm:
    """Unpack an immediate produced by :func:`encode_imm`.

    Raises ``ValueError`` if ``imm`` is not an unsigned 32-bit integer.
    """
    if not isinstance(imm, int) or not 0 <= imm <= 0xFFFFFFFF:
        raise ValueError(f"immediate {imm!r} is not an unsigned 32-bit integer")
    return Imm(
        layer=(imm >> LAYER_SHIFT) & MAX_LAYER,
        microbatch=(imm >> MICROBATCH_SHIFT) & MAX_MICROBATCH,
        slot=(imm >> SLOT_SHIFT) & MAX_SLOT,
        tag=(imm >> TAG_SHIFT) & MAX_TAG,
    )


def slot_of(imm: int) -> int:
    """The slot field of an immediate (the hot path of every receiver)."""
    return imm & MAX_SLOT
