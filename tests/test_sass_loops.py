"""tools/sass_loops.py's SASS parsing on synthetic cuobjdump text: which loop counts as a
kernel's hot loop, and the kernels' labels (the compile and cuobjdump steps need the CUDA
toolkit and are not run here)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import sass_loops  # noqa: E402

WS = "_ZN4kbit4cuda5fused21kbit_matmul_ws_kernelILi4ENS0_7ActBF16ELi1ELi1EEEvNS1_6ParamsE14CUtensorMap_stS5_S5_"
CP = "_ZN4kbit4cuda5fused24kbit_matmul_fused_kernelILi2ENS0_6ActF16ELi8ELi0EEEvNS1_6ParamsE"
WG = "_ZN4kbit4cuda5wgmma24kbit_matmul_wgmma_kernelILi4ELi128EEEvNS1_8WgParamsE14CUtensorMap_st"


def line(addr, ins):
    return f"        /*{addr:04x}*/                   {ins} ;     /* 0x000000000000 */"


def function(name, body):
    return "\n".join([f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"'] +
                     [line(a, i) for a, i in body])


SASS = "\n".join([
    "\tcode for sm_90",
    function(WS, [
        (0x00, "LDC R1, c[0x0][0x28]"),
        (0x10, "IADD3 R2, R1, 0x1, RZ"),             # outer loop: 0x10 .. 0x70
        (0x20, "LDS R4, [R2]"),                      # inner (hot) loop: 0x20 .. 0x50
        (0x30, "HMMA.16816.F32.BF16 R8, R4, R6, R8"),
        (0x40, "ISETP.NE.AND P0, PT, R2, RZ, PT"),
        (0x50, "@P0 BRA 0x20"),
        (0x60, "STG.E [R10], R8"),
        (0x70, "@P1 BRA 0x10"),
        (0x80, "BRA 0x90"),                          # forward branch: not a loop
        (0x90, "EXIT"),
    ]),
    function(CP, [
        (0x00, "MOV R1, RZ"),
        (0x10, "IADD3 R1, R1, 0x1, RZ"),             # a loop without HMMA does not count
        (0x20, "@P0 BRA 0x10"),
        (0x30, "EXIT"),
    ]),
    function(WG, [
        (0x00, "WARPGROUP.ARRIVE"),                  # chunk loop: 0x00 .. 0x40
        (0x10, "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24"),
        (0x20, "@P2 BRA.U.ANY 0x20"),                # a copy's tiny loop, no HGMMA in it
        (0x30, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),
        (0x40, "@!P0 BRA 0x0"),
        (0x50, "EXIT"),
    ]),
])


def test_functions_splits_the_dump_by_kernel():
    fns = sass_loops.functions(SASS)
    assert list(fns) == [WS, CP, WG]
    assert fns[WS][2] == (0x20, "LDS R4, [R2]") and len(fns[WS]) == 10 and len(fns[CP]) == 4


def test_hot_loop_is_the_shortest_loop_around_an_mma():
    fns = sass_loops.functions(SASS)
    assert sass_loops.hot_loop_size(fns[WS]) == 4      # 0x20 .. 0x50, not the outer 0x10 .. 0x70
    assert sass_loops.hot_loop_size(fns[CP]) is None   # no HMMA at all
    assert sass_loops.hot_loop_size(fns[WG]) == 5      # wgmma's HGMMA counts: 0x00 .. 0x40
    assert sass_loops.hot_loop_size([]) is None


def test_labels_name_the_template_arguments():
    assert sass_loops.label(WS) == "ws bits 4 ActBF16 MT 1 kWarpKPair"
    assert sass_loops.label(CP) == "cp.async bits 2 ActF16  MT 8 kWarpKBlock"
    assert sass_loops.label(WG) == "wgmma bits 4 BM 128"
    # J, the weight tiles per warpgroup
    assert sass_loops.label(WG.replace("Li128E", "Li128ELi1E")) == "wgmma bits 4 BM 128 J 1"
    # the activation type: fp16 kernels apart, bf16 ones paired with trees whose kernels lack it
    assert sass_loops.label(WG.replace("Li128E", "Li128ELi1ENS0_6ActF16E")) == "wgmma bits 4 BM 128 J 1 ActF16"
    assert sass_loops.label(WG.replace("Li128E", "Li128ELi1ENS0_7ActBF16E")) == "wgmma bits 4 BM 128 J 1"
    assert sass_loops.label("_Z8quantizev") == "_Z8quantizev"


def test_missing_cuobjdump_is_a_clear_error(capsys):
    assert sass_loops.main(["--cuobjdump", "/nonexistent/cuobjdump"]) == 2
    assert "no cuobjdump" in capsys.readouterr().err


def test_identity_ignores_anonymous_namespace_hashes_only(capsys):
    anon = "Function : _ZN12_GLOBAL__N__{}_7kernelEv\n        /*0000*/   EXIT ;"
    same = {"quantize": {"ref": anon.format("3f2a"), "new": anon.format("91bc")}}
    assert sass_loops.report_identity(same) == 0
    changed = {"quantize": {"ref": anon.format("3f2a"), "new": anon.format("91bc").replace("EXIT", "BRA 0x0")}}
    assert sass_loops.report_identity(changed) == 1
    assert capsys.readouterr().out.splitlines() == ["quantize: identical SASS",
                                                    "quantize: SASS differs (2 lines)"]


def test_loops_pair_kernels_by_template_arguments(capsys):
    # the wgmma kernel's parameter list changed (two more tensor maps), a BM = 256 kernel is new,
    # and a cp.async kernel without a loop around its MMA is in neither column
    wg_new_params = WG.replace("CUtensorMap_st", "CUtensorMap_stS3_S3_")
    wg256 = WG.replace("Li128E", "Li256E")
    body = [(0x00, "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24"), (0x10, "@!P0 BRA 0x0")]
    longer = [(0x00, "LDS R4, [R2]")] + [(a + 0x10, i) for a, i in body]
    sass = {"matmul_wgmma_b4": {"ref": "\n".join([function(WG, body), function(CP, [(0, "EXIT")])]),
                                "new": "\n".join([function(wg_new_params, longer), function(wg256, body)])}}
    assert sass_loops.report_loops(sass, "HEAD", max_growth=0) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "hot loop (instructions), HEAD -> working tree"
    assert [ln.split() for ln in lines[1:]] == [
        ["matmul_wgmma_b4:", "wgmma", "bits", "4", "BM", "128", "2", "->", "3", "(+1)"],
        ["matmul_wgmma_b4:", "wgmma", "bits", "4", "BM", "256", "-", "->", "2", "(new)"]]


def test_loops_of_equal_length_in_another_order_are_marked_reordered(capsys):
    # renamed registers and other immediates are the same loop; two instructions swapped are not
    loop = [(0x00, "LDS R4, [R2+0x10]"), (0x10, "HMMA.16816.F32.BF16 R8, R4, R6, R8"),
            (0x20, "IADD3 R2, R2, 0x20, RZ"), (0x30, "@P0 BRA 0x0")]
    renamed = [(a, i.replace("R4", "R5").replace("0x10]", "0x30]")) for a, i in loop]
    swapped = [loop[0], (0x10, loop[2][1]), (0x20, loop[1][1]), loop[3]]
    assert sass_loops.moved(loop, renamed) == 0 and sass_loops.moved(loop, swapped) == 2
    sass = {"matmul_fused_b4": {"ref": function(WS, loop), "new": function(WS, swapped)},
            "matmul_fused_b2": {"ref": function(WS, loop), "new": function(WS, renamed)}}
    assert sass_loops.report_loops(sass, "HEAD", max_growth=0) == 0  # (not growth)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-4:] == ["4", "(reordered:", "2", "moved)"]
    assert lines[2].split()[-3:] == ["4", "->", "4"]


def test_ops_lists_the_opcodes_whose_count_changed(capsys):
    # predicates and modifiers do not count: "@!P0 IMAD.MOV.U32" is an IMAD
    assert sass_loops.opcode("@!P0 IMAD.MOV.U32 R3, RZ, RZ, R5") == "IMAD"
    assert sass_loops.opcode("HMMA.16816.F32.BF16 R8, R4, R6, R8") == "HMMA"
    ref = [(0x00, "LDS R4, [R2]"), (0x10, "MOV R5, R4"), (0x20, "IMAD.MOV.U32 R6, RZ, RZ, R4"),
           (0x30, "HMMA.16816.F32.BF16 R8, R4, R6, R8"), (0x40, "@P0 BRA 0x0")]
    new = [(0x00, "LDS R4, [R2]"), (0x10, "LOP3.LUT R5, R4, 0xf0f0f0f, R3, 0xe4, !PT"),
           (0x20, "HMMA.16816.F32.BF16 R8, R4, R6, R8"), (0x30, "@P0 BRA 0x0")]
    assert sass_loops.opcode_changes(ref, new) == "IMAD -1  LOP3 +1  MOV -1"
    assert sass_loops.opcode_changes(ref, ref) == ""
    sass = {"matmul_fused_b4": {"ref": function(WS, ref), "new": function(WS, new)}}
    assert sass_loops.report_loops(sass, "HEAD", max_growth=None, ops=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-4:] == ["5", "->", "4", "(-1)"]
    assert lines[2].split() == ["IMAD", "-1", "LOP3", "+1", "MOV", "-1"]


def test_cache_reuses_a_revisions_cubins(tmp_path, monkeypatch):
    # compile_cubin stubbed (no nvcc here) and a disassembler that prints the "cubin": a revision's
    # cubins are compiled once into cache/<commit>/, the working tree's every time
    compiled = []
    dis = tmp_path / "cuobjdump"
    dis.write_text('#!/bin/sh\ncat "$2"\n')  # (called as: cuobjdump -sass FILE)
    dis.chmod(0o755)

    def fake_compile(src, include, out):
        compiled.append(os.path.relpath(src, os.path.dirname(include)))
        with open(out, "w") as f:
            f.write(f"Function : k\n        /*0000*/   EXIT ;  // {os.path.basename(src)}\n")

    monkeypatch.setattr(sass_loops, "compile_cubin", fake_compile)
    unit = os.path.join(sass_loops.ROOT, "cpp", "cuda", "quantize.cu")
    for run in range(2):
        work = tmp_path / f"work{run}"
        work.mkdir()
        sass = sass_loops.disassemble([unit], "HEAD", str(work), str(dis), cache=str(tmp_path / "cache"))
        assert sass_loops.report_identity(sass) == 0
    assert compiled == [os.path.join("cpp", "cuda", "quantize.cu")] * 3  # ref once, the working tree twice
    (commit,) = os.listdir(tmp_path / "cache")
    assert len(commit) == 40 and os.listdir(tmp_path / "cache" / commit) == ["quantize.cubin"]
