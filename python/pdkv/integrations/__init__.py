"""Integrations of pdkv with serving engines (vLLM). Importing this package imports no engine."""
