"""vLLM topk ops with vLLM's call signatures (filled in by the compat work of issue 10)."""

__all__: list[str] = []
