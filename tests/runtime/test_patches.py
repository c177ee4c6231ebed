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


def test_large_cpu_tensors_are_filled_by_tiling_a_seeded_block(monkeypatch):
    """A 70B shape's CPU half is 70 GB: upstream's uniform_ fills it on one thread. Large CPU tensors
    repeat one block filled by upstream's own function; small ones (tiny test models) keep its values."""
    monkeypatch.setattr(patches, "TILE", 1 << 10)
    big = lambda: torch.nn.Sequential(torch.nn.Linear(512, 20, bias=False), torch.nn.Linear(8, 4))  # noqa: E731
    upstream = load_dummy(big())
    monkeypatch.setattr(dummy_loader.DummyModelLoader, "load_weights", dummy_loader.DummyModelLoader.load_weights)
    monkeypatch.setattr(patches, "APPLIED", [])
    patches.patch_dummy_weights_once(dummy_loader)
    patched = load_dummy(big())
    w = patched["0.weight"].flatten()  # 10240 elements: 10 tiles
    block = torch.empty(1 << 10)
    dummy_loader.initialize_dummy_weights(patches._Tensors({"b": block}), None)
    assert torch.equal(w.view(10, -1), block.expand(10, -1))
    assert w.abs().max() <= 1e-3 and w.std() > 1e-4
    assert all(torch.equal(patched[k], upstream[k]) for k in ("1.weight", "1.bias"))  # below 4 tiles: upstream's
