"""vLLM backend (env "vllm" on GPU machines, "vllm-cpu" elsewhere)."""
