import pytest
from pipelines import GPT_OSS_ENV, GPT_OSS_TOKENS, MAX_TOKENS, PROMPTS, reference
from vllm_hybrid.tinymodel import make_tiny_gpt_oss, make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """4-layer random Llama in float32 (GPU and CPU kernels agree exactly only in float32)."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", layers=4, dtype="float32")


@pytest.fixture(scope="session")
def reference_outputs(tiny_llama):
    """Single-process vLLM on the tiny Llama: each prompt's greedy tokens, its prompt ids, and its continuation
    scored teacher-forced (pipelines.score's measure)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return reference(tiny_llama, PROMPTS, MAX_TOKENS, env=env, score_generated=True)


@pytest.fixture(scope="session")
def reference_ids(reference_outputs):
    return [r["ids"] for r in reference_outputs]


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory):
    """The same, as a mixture of experts (Mixtral: 4 experts, 2 routed per token)."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-mixtral", layers=4, dtype="float32", experts=4)


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory):
    """A mixture of experts with a shared expert that every token runs (Qwen2-MoE: 4 experts, 2 routed)."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-qwen2-moe", layers=4, dtype="float32", experts=4,
                           shared=192)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory):
    """A 4-layer gpt-oss whose experts are MXFP4, as gpt-oss ships (4 experts, 2 routed; bf16 elsewhere)."""
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("models") / "tiny-gpt-oss", layers=4)


@pytest.fixture(scope="session")
def gpt_oss_reference_ids(tiny_gpt_oss):
    """Single-process vLLM's greedy tokens for two prompts on it, in bf16 (one start for every test that compares)."""
    return [r["ids"] for r in reference(tiny_gpt_oss, PROMPTS[:2], GPT_OSS_TOKENS, dtype="bfloat16", env=GPT_OSS_ENV)]
