"""reco.cpu: the CPU as /proc/cpuinfo tells it (its INT8 saturation is tested with the quantizer, test_steps.py)."""

from __future__ import annotations

from reco.cpu import cpu_description, cpu_model


def test_the_cpu_is_named_with_what_tells_its_kind_apart():
    """The name "AMD EPYC" alone has named a Zen 3 with AVX2 only and a Zen 4 with AVX-512 VNNI here: a
    report must say which, from the first processor's block of /proc/cpuinfo."""
    block = (
        "processor\t: {i}\nvendor_id\t: {v}\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: {name}\n"
        "flags\t\t: {flags}\n"
    )

    def cpuinfo(**kw: str) -> str:
        return "\n".join(block.format(i=i, **kw) for i in range(2))

    zen3 = cpuinfo(v="AuthenticAMD", f="25", m="1", name="AMD EPYC", flags="fpu sse2 avx avx2 fma")
    assert cpu_description(zen3) == "AMD EPYC (family 25 model 1; AVX2)"
    zen4 = cpuinfo(v="AuthenticAMD", f="25", m="17", name="AMD EPYC", flags="avx2 avx512f avx512_vnni")
    assert cpu_description(zen4) == "AMD EPYC (family 25 model 17; AVX-512 VNNI)"
    xeon = cpuinfo(
        v="GenuineIntel", f="6", m="143", name="Intel Xeon", flags="avx2 avx512f avx512_vnni amx_tile"
    )
    assert cpu_description(xeon) == "Intel Xeon (family 6 model 143; AVX-512 VNNI, AMX)"
    assert cpu_description("") == "unknown"
    # this machine's own: x86-64 here, so one of the vector extensions is named
    assert any(isa in cpu_model() for isa in ("AVX2", "AVX-512")), cpu_model()
