"""The draft's acceptance, measured through vLLM speculative decoding, and the depth to deploy."""
