"""This machine's CPU as /proc/cpuinfo tells it: what a report names it by, and whether its INT8 dot
products can saturate. One reader for both, so the report names the CPU by the flags the kernels choose on.

"AMD EPYC" alone has been a Zen 3 with AVX2 only and a Zen 4 with AVX-512 VNNI here, about 2x apart:
oneDNN, FBGEMM and ONNX Runtime take the widest vector instructions they find, so a report that names only
the model compares unlike machines.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# int8 dot products without saturation (VPDPBUSD, AMX tiles); without them u8s8 MatMul uses VPMADDUBSW
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo text as key -> value (every vCPU here is alike)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the blank line that ends the first block
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_description(cpuinfo: str) -> str:
    """'AMD EPYC (family 25 model 1; AVX2)' from /proc/cpuinfo text: the model name with its family, model
    and widest vector extension (VNNI where int8 dot products have it, AMX); "unknown" without a model name."""
    fields = cpu_fields(cpuinfo)
    model = fields.get("model name", "unknown")
    flags = set(fields.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    isa += " VNNI" if isa and flags & (VNNI_FLAGS - {"amx_int8"}) else ""
    isa += ", AMX" if "amx_tile" in flags else ""
    kind = f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
    detail = "; ".join(x for x in (kind, isa) if x)
    return f"{model} ({detail})" if detail and model != "unknown" else model


def cpu_model() -> str:
    """This machine's CPU (cpu_description; "unknown" where /proc/cpuinfo cannot be read): every report names it."""
    try:
        return cpu_description(CPUINFO.read_text())
    except OSError:
        return "unknown"


def int8_saturates(cpuinfo: Path = CPUINFO) -> bool:
    """Whether ONNX Runtime's u8s8 MatMul can saturate on this CPU: x86 without VNNI (or AMX) multiplies with
    VPMADDUBSW, whose pairwise u8 x s8 sums saturate at int16: there INT8 scores drifted far enough to fail
    the AUC guard (experiments/optimize_chain/README.md); 7-bit weights (reduce_range) cannot saturate. Non-x86: False."""
    try:
        fields = cpu_fields(cpuinfo.read_text())
    except OSError:
        return True  # unknown: 7-bit weights are safe everywhere
    if "flags" not in fields:  # no x86 flags line (e.g. aarch64 lists "Features")
        return False
    return not VNNI_FLAGS & set(fields["flags"].split())
