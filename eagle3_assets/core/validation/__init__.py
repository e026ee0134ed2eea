"""Keeping or rejecting each raw response, rendering the kept ones into the target's tokens, and the gates."""
