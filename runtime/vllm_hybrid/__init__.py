"""HybridInference runtime: heterogeneous CUDA + CPU pipeline parallelism for vLLM."""
