"""benchmarks/pdl_ptx_check.py's count of programmatic-launch instructions in XLA's dumped files (no GPU needed)."""

from __future__ import annotations

import os

import pdl_ptx_check


def test_counts_each_instruction_in_the_files_that_hold_one(tmp_path):
    (tmp_path / "module.ptx").write_text("griddepcontrol.wait;\n ld.global\n griddepcontrol.wait;\n"
                                         "griddepcontrol.launch_dependents;\n")
    (tmp_path / "module.hlo.txt").write_text("custom-call(...)\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "kernel.ll").write_text("call void asm sideeffect \"griddepcontrol.launch_dependents;\"")
    assert pdl_ptx_check.counts(dict(pdl_ptx_check.dumped_texts(str(tmp_path)))) == {
        "module.ptx": {"griddepcontrol.wait": 2, "griddepcontrol.launch_dependents": 1},
        os.path.join("sub", "kernel.ll"): {"griddepcontrol.wait": 0, "griddepcontrol.launch_dependents": 1}}


def test_compiled_files_are_ptx_or_llvm_ir_naming_the_kernel(tmp_path):
    (tmp_path / "a.ptx").write_text(".entry pdl_probe(\n griddepcontrol.wait;")
    (tmp_path / "b.ll").write_text("define void @other_kernel()")
    (tmp_path / "c.txt").write_text("custom_call_target=pdl_probe")  # HLO text: not compiled code
    assert pdl_ptx_check.compiled_files(dict(pdl_ptx_check.dumped_texts(str(tmp_path))),
                                        "pdl_probe") == ["a.ptx"]
