"""The ptxas/SASS summary of lab/kernels/mosaic_resources.py, on files like its dumps."""

from lab.kernels.mosaic_resources import summarise


def test_summary_keeps_ptxas_findings_and_counts_sass_opcodes(tmp_path):
    (tmp_path / "k.ptxas").write_text(
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized\n"
        "ptxas warning : Registers are spilled to local memory, 8 bytes spill stores\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n")
    (tmp_path / "k.sass").write_text(
        "        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;\n"
        "        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
        "        /*0120*/                   STL [R1+0x8], R2 ;\n"
        "        /*0130*/                   LDL R2, [R1+0x8] ;\n"
        "        /*0140*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;\n")
    res = summarise(str(tmp_path))
    assert sorted(res["files"]) == ["k.ptxas", "k.sass"]
    assert len(res["ptxas"]) == 3 and "0 bytes gmem" not in " ".join(res["ptxas"])
    assert res["sass_counts"] == {"HGMMA": 2, "WARPGROUP.DEPBAR": 1, "STL": 1, "LDL": 1}
