"""OpenAI-compatible serving for jaxdsa models."""
