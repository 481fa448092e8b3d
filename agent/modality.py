"""The modalities a span, a packet or a GPU launch is tagged with: the one
definition (stdlib only, so the client imports it without the agent)."""

from __future__ import annotations

import enum


class Modality(enum.IntEnum):
    """The number the span-context marker, the kernel maps and the ring-buffer
    records carry (bpf/spanlet_types.h SPANLET_MOD_*, checked by a unit test)."""
    other = 0
    text = 1
    image = 2
    audio = 3
    video = 4


# The named modalities in number order, then `other`: how config and the
# serving labels spell them.
NAMES: tuple[str, ...] = tuple(m.name for m in sorted(Modality, key=lambda m: (m is Modality.other, m)))
NAMED: tuple[str, ...] = tuple(n for n in NAMES if n != Modality.other.name)   # text, image, audio, video
NUMBERS: dict[str, int] = {m.name: int(m) for m in Modality}


def modality_name(number: int) -> str:
    """The name of a modality number; `other` for one this agent does not know."""
    return Modality(number).name if 0 <= number < len(Modality) else Modality.other.name
