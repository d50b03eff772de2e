"""The AMD architectures this backend targets, and what each one's hardware has.

An architecture is named as the driver reports it (`gcnArchName`, e.g. "gfx942:sramecc+:xnack-"; the part
before the first colon is the name). Triton's HIP backend compiles for CDNA2 and later and for RDNA3 and
later; older parts (gfx906, gfx908, gfx1030) are refused by name rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass

from poot_core import Reason, Unsupported


@dataclass(frozen=True)
class AmdArch:
    """One architecture: its family, wavefront width, the FP8 formats its matrix cores take (empty: none)
    and the name of its entry in poot_kernels_triton.tuning.TUNINGS."""

    name: str
    family: str
    wave_size: int
    fp8_formats: tuple[str, ...]
    tuning: str


ARCHITECTURES: dict[str, AmdArch] = {
    a.name: a
    for a in (
        AmdArch("gfx90a", "CDNA2 (MI200)", 64, (), "hip.gfx90a"),
        # CDNA3 computes the FNUZ variants (no negative zero, bias 8); OCP e4m3fn needs a conversion.
        AmdArch("gfx942", "CDNA3 (MI300)", 64, ("e4m3fnuz", "e5m2fnuz"), "hip.gfx942"),
        AmdArch("gfx950", "CDNA4 (MI350)", 64, ("e4m3fn", "e5m2"), "hip.gfx942"),
        AmdArch("gfx1100", "RDNA3 (RX 7900)", 32, (), "hip.gfx1100"),
        AmdArch("gfx1101", "RDNA3 (RX 7800/7700)", 32, (), "hip.gfx1100"),
        AmdArch("gfx1102", "RDNA3 (RX 7600)", 32, (), "hip.gfx1100"),
        AmdArch("gfx1200", "RDNA4 (RX 9060)", 32, ("e4m3fn", "e5m2"), "hip.gfx1100"),
        AmdArch("gfx1201", "RDNA4 (RX 9070)", 32, ("e4m3fn", "e5m2"), "hip.gfx1100"),
    )
}


def arch_name(gcn_arch_name: str) -> str:
    """ "gfx942:sramecc+:xnack-" -> "gfx942"."""
    return str(gcn_arch_name).split(":", 1)[0].strip()


def arch_info(gcn_arch_name: str) -> AmdArch:
    """The table entry of an architecture, or a refusal naming it and the ones that are known."""
    name = arch_name(gcn_arch_name)
    info = ARCHITECTURES.get(name)
    if info is None:
        raise Unsupported(
            Reason.BACKEND,
            f"rocm on {name or 'an unnamed AMD architecture'}",
            f"the Triton kernels are built and tuned for {', '.join(ARCHITECTURES)}; this GPU is none of them",
        )
    return info
