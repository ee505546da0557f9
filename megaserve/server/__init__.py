"""Serving endpoint: one process, one asyncio loop, two APIs over one engine.

* ``grpc_service``: ``megaserve.v1.Generation`` (``generation.proto``), health, reflection.
* ``openai_http``: OpenAI-compatible HTTP (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/openapi.json``); ``openai_models`` (the
  request bodies as pydantic models, the OpenAPI document), ``openai_protocol`` (body →
  checked request, responses, SSE), ``http_errors`` (JSON errors, API key, body limits),
  ``token_bytes`` (a token's real bytes for logprobs).
* ``grpc_protocol``: linear-time checks of GenerateRequest bytes, proto ↔ SamplingParams.
* ``metrics``: prometheus_client, vLLM's names, a ``model_name`` label.
* ``core``: what both share — admission (waiting cap, draining), validation, the streaming
  loop that turns the engine's cumulative outputs into deltas, abort on cancel, metrics.
* ``app``: wiring, startup (model load in a thread, health NOT_SERVING until then) and the
  SIGTERM drain. ``cli``: ``megaserve serve``. ``client``: ``megaserve generate --server``.

Nothing is imported eagerly: ``import megaserve.server`` does not import torch or grpc.
"""

from __future__ import annotations
