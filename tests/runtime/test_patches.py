"""Patches that can be checked in-process, against the real vLLM functions they wrap."""
import torch
from vllm.model_executor.model_loader import dummy_loader
from vllm_hybrid import patches


def nested_model():
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Sequential(torch.nn.Linear(32, 8)))
    return torch.nn.Sequential(block(), block(), torch.nn.Embedding(100, 16))


def load_dummy(model):
    dummy_loader.DummyModelLoader.load_weights(object.__new__(dummy_loader.DummyModelLoader), model, None)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_dummy_weights_filled_once_with_the_same_values(monkeypatch):
    upstream = load_dummy(nested_model())
    calls = []
    init = dummy_loader.initialize_dummy_weights
    monkeypatch.setattr(dummy_loader, "initialize_dummy_weights",
                        lambda layer, *a, **k: (calls.append(len(layer.state_dict())), init(layer, *a, **k)))
    monkeypatch.setattr(dummy_loader.DummyModelLoader, "load_weights", dummy_loader.DummyModelLoader.load_weights)
    monkeypatch.setattr(patches, "APPLIED", [])
    patches.patch_dummy_weights_once(dummy_loader)
    patched = load_dummy(nested_model())
    assert patched.keys() == upstream.keys()
    assert all(torch.equal(patched[k], upstream[k]) for k in upstream)
    assert sum(calls) == len(upstream)  # each of the 9 tensors once (upstream: once per enclosing module)
    assert all(v.abs().max() <= 1e-3 and v.std() > 0 for v in patched.values())
