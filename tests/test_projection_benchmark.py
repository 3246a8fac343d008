"""benchmarks/projection.py's helpers: tile specs (one for both calls, or input / o_proj pairs) and the readout of
XLA's GEMM tile choices from a compiled HLO module (synthetic HLO text)."""

from __future__ import annotations

import pytest

import projection as projection_benchmark


HLO = """
  %gemm_fusion_dot.12 = bf16[16,6144]{1,0} fusion(%a, %b), kind=kCustom, calls=%x, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"256","split_k":"8","num_stages":"4","num_warps":"4","num_ctas":"1"}}}
  %gemm_fusion_dot.13 = bf16[16,6144]{1,0} fusion(%c, %d), kind=kCustom, calls=%y, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"256","split_k":"8","num_stages":"4","num_warps":"4","num_ctas":"1"}}}
  %custom-call.2 = (bf16[16,2048]{1,0}, s8[0]{0}) custom-call(%e, %f), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %loop_add_fusion = bf16[16,2048]{1,0} fusion(%g, %h), kind=kLoop, calls=%z, backend_config={"fusion_backend_config":{"kind":"__loop"}}
"""


def test_tile_pairs():
    one = projection_benchmark.parse_tile_pair("128x64s3p1024k8w2")
    assert one[0] == one[1] and one[0].block_n == 128 and one[0].num_warps == 2 and one[0].k_slices == 8
    inputs, output = projection_benchmark.parse_tile_pair("128x64s3p1024k8w2/64x32s4p256k16")
    assert (inputs.block_n, output.block_n, output.step_k, output.num_stages, output.min_programs,
            output.k_slices, output.num_warps) == (128, 64, 32, 4, 256, 16, 4)
    with pytest.raises(SystemExit, match="not <block_n>"):
        projection_benchmark.parse_tile_pair("128x64/64")


def test_gemm_configs_are_read_from_compiled_hlo():
    configs = projection_benchmark.gemm_configs(HLO)
    assert len(configs) == 2  # the two Triton GEMMs share a name stem and a config: one entry; the cuBLAS call
    assert configs[0].startswith("gemm_fusion_dot: ")
    assert '"split_k":"8"' in configs[0] and '"block_k":"256"' in configs[0]
    assert configs[1].startswith("custom-call: ") and "gemm_backend_config" in configs[1]
