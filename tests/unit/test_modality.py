"""The one modality definition: bpf/spanlet_types.h's numbers, the decoder, the
client and the config all agree with spanlet.modality."""

import re

from spanlet import client, config, events, modality
from spanlet.modality import Modality, modality_name
from spanlet.probes.base import BPF_DIR


def c_modalities() -> tuple[dict[str, int], int]:
    text = (BPF_DIR / "spanlet_types.h").read_text()
    numbers = {m.group(1).lower(): int(m.group(2))
               for m in re.finditer(r"^#define SPANLET_MOD_(\w+) (\d+)", text, re.M)}
    count = int(re.search(r"^#define SPANLET_N_MODALITIES (\d+)", text, re.M).group(1))
    return numbers, count


def test_the_c_defines_equal_the_python_definition():
    numbers, count = c_modalities()
    assert numbers == {m.name: m.value for m in Modality}
    assert count == len(Modality)


def test_every_user_reads_the_one_definition():
    assert events.Modality is Modality
    assert client.MODALITIES == {m.name: m.value for m in Modality}
    assert [m.value for m in config.Modality] == list(modality.NAMES)
    assert set(modality.NAMES) == {m.name for m in Modality}
    assert modality.NAMES[-1] == "other" and "other" not in modality.NAMED


def test_a_number_past_the_known_ones_is_other():
    assert modality_name(3) == "audio"
    assert modality_name(len(Modality)) == "other"
    assert modality_name(255) == "other"
