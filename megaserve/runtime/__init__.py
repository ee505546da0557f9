"""Disaggregated runtime: attention workers and expert workers over the comm transport.

* :mod:`placement` — which expert worker holds which expert.
* :mod:`frames` — the dispatch / combine payloads.
* :mod:`remote_experts` — the attention side's ExpertClient over an endpoint.
* :mod:`expert_worker` — the expert side's serve loop (per-layer aggregation).
* :mod:`attention_worker` — an engine replica driven by commands.
* :mod:`cluster` — the front-end engine: launch, route, collect, shut down.
"""
