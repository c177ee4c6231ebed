import pytest
from vllm_hybrid.tinymodel import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """4-layer random Llama in float32 (GPU and CPU kernels agree exactly only in float32)."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", layers=4, dtype="float32")
