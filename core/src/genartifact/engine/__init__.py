"""Engine glue (vLLM). Importing this package imports nothing heavy; submodules import vllm/torch."""
