"""Regenerating the target's responses through an OpenAI-compatible server (vLLM, SGLang), resumably."""
