"""Where the GPU probe puts a uprobe in a function: past a leading compare of a
RIP-relative operand when a conditional jump follows (NVIDIA's trampolines),
else on the entry."""

import pytest

from spanlet.probes.gpu import probe_skip

TRAMPOLINE = bytes.fromhex("813d7e928d0100ba1c32"   # cmpl $0x321cba00, 0x18d927e(%rip)
                           "740c"                   # je +12
                           "ff2506187e01"           # jmp *0x17e1806(%rip)
                           "660f1f440000")          # nopw


@pytest.mark.parametrize("code, skip", [
    (TRAMPOLINE, 10),                                           # libcuda 535 and 580, the stand-in
    (bytes.fromhex("833d112233440a" "7505"), 7),                # cmpl $imm8; jne rel8
    (bytes.fromhex("48813d11223344aabbccdd" "0f8410000000"), 11),   # cmpq $imm32; je rel32
    (bytes.fromhex("803d1122334400" "0f8f00010000"), 7),        # cmpb $imm8; jg rel32
    (bytes.fromhex("813d7e928d0100ba1c32" "ff25"), 0),          # no conditional jump after it
    (bytes.fromhex("813d7e928d0100ba1c32"), 0),                 # cut short
    (bytes.fromhex("813d7e92"), 0),
    (bytes.fromhex("55" "4889e5"), 0),                          # push %rbp: emulated at the entry
    (bytes.fromhex("f30f1efa" "813d7e928d0100ba1c32" "740c"), 0),   # endbr64 first: left alone
    (bytes.fromhex("813c257e928d0100ba1c32" "740c"), 0),        # cmp with an absolute address (SIB)
    (bytes.fromhex("3b057e928d01" "740c"), 0),                  # cmp reg, [rip]: not this shape
    (b"", 0),
])
def test_probe_skip(code, skip):
    assert probe_skip(code) == skip
