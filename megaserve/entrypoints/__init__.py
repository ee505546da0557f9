"""User-facing entry points: the LLM class and CLI commands."""
