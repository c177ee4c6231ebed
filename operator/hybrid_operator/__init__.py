"""HybridInference Kubernetes operator."""
