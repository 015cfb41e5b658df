"""vLLM with pdkv's connector beside vLLM's own NixlConnector, measured in one run
(needs vLLM; see docs/vllm.md)."""
