"""The built wheel (scripts/wheel) holds libsage.so with the kernels of every default arch, needing
only the C/C++ runtimes (no libcudart, no libcuda): the checks of check_wheel.py. Skipped where
no wheel has been built (CI does not build one: scripts/wheel compiles every kernel for every
arch); SAGE_WHEEL names one, else the newest dist/sage_attn-*.whl."""
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_wheel  # noqa: E402


def _wheel():
    env = os.environ.get("SAGE_WHEEL")
    return pathlib.Path(env) if env else check_wheel.latest_wheel()


@pytest.mark.skipif(_wheel() is None, reason="no wheel built (scripts/wheel)")
def test_wheel_is_portable_and_has_every_arch():
    found = check_wheel.check(_wheel(), check_wheel.default_archs())
    assert not any("cudart" in n or "libcuda" in n for n in found["needed"])


def test_fatbin_reader_on_a_synthetic_fatbin():
    # Two entries as nvcc 13.0 lays them out: SASS for sm_90a (flag bit 20), PTX for compute_89.
    import struct

    def entry(kind, sm, flags, payload):
        head = struct.pack("<HHIQ", kind, 0x101, 64, len(payload)) + bytes(12)
        head += struct.pack("<I", sm) + bytes(8) + struct.pack("<I", flags)
        head += bytes(64 - len(head))
        return head + payload

    body = entry(2, 90, 0x100011, b"\x7fELF" + bytes(12)) + entry(1, 89, 0x8011, bytes(8))
    fatbin = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
    assert check_wheel.fatbin_entries(fatbin) == [("sass", 90, True), ("ptx", 89, False)]
