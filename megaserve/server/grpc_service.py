"""The ``megaserve.v1.Generation`` service on grpc.aio, plus health and reflection.

Health: overall (``""``) and readiness (``megaserve.v1.Generation``) are NOT_SERVING until
the model is loaded, from the start of a drain, and once the engine has failed.

The handlers are registered by hand (not with the generated ``add_*_to_server``) so that
GenerateRequest goes through ``grpc_protocol.deserialize_generate``: malformed requests get
INVALID_ARGUMENT with a field name instead of grpc's generic INTERNAL.

Authentication: with an API key, every ``megaserve.v1.Generation`` call needs the metadata
``authorization: Bearer <key>`` (UNAUTHENTICATED otherwise); health and reflection stay
open, like vLLM's ``/health``. ``Abort`` acts only on requests the same connection started.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from megaserve import __version__
from megaserve.server import generation_pb2 as pb
from megaserve.server.core import Delta, ServerState, ServingCore
from megaserve.server.errors import RequestError
from megaserve.server.auth import identity, matching_key, normalize_keys
from megaserve.server.grpc_protocol import (
    SERVICE_NAME, BadMessage, deserialize_generate, logprobs_to_proto, parse_generate,
    safe_deserializer)
from megaserve.server.sampling_checks import check_for_model
from megaserve.service import LIVENESS_NAME

logger = logging.getLogger(__name__)

# Enough for any prompt the size cap lets through; larger messages get RESOURCE_EXHAUSTED
# from grpc itself.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class GenerationService:
    """Implements the four RPCs on top of a ServingCore."""

    def __init__(self, core: ServingCore, dtype: str | Callable[[], str], device: str) -> None:
        self.core = core
        self._dtype = dtype
        self.device = device
        self.api_keys: tuple[str, ...] = ()  # set by build_grpc_server

    @property
    def dtype(self) -> str:
        """The dtype the model runs in (resolved: never ``auto`` once loaded)."""
        return self._dtype() if callable(self._dtype) else self._dtype

    async def Generate(self, request: pb.GenerateRequest | BadMessage,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        core = self.core
        started = False
        try:
            if isinstance(request, BadMessage):
                raise request.error
            parsed = parse_generate(request)
            request_id = parsed.request_id or uuid.uuid4().hex
            with core.admit(request_id, self._owner(context)) as engine_id:
                params = check_for_model(core.engine, parsed.params)
                prompt_ids = await core.prepare(parsed.prompt, params, _input_field(request))
                async with contextlib.aclosing(
                        core.stream(engine_id, prompt_ids, params)) as deltas:
                    async for delta in deltas:
                        started = True
                        if parsed.stream and delta.token_ids:
                            yield pb.GenerateResponse(chunk=_chunk(delta))
                        if delta.finish_reason is not None:
                            yield pb.GenerateResponse(complete=_complete(request_id, delta))
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code.grpc_name), e.message)
        except Exception as e:  # an engine failure: report it in-stream, then as a status
            logger.exception("Generate failed")
            # The server log has the details; the client gets no internals (a worker's
            # failure can carry its traceback).
            message = f"internal error: {type(e).__name__} (see the server log)"
            if started:
                yield pb.GenerateResponse(error=pb.Error(message=message, code="INTERNAL"))
            await context.abort(grpc.StatusCode.INTERNAL, message)

    async def Abort(self, request: pb.AbortRequest | BadMessage,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        return pb.AbortResponse(
            found=await self.core.abort(request.request_id, self._owner(context)))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        engine = self.core.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is loading the model")
        return pb.GetModelInfoResponse(
            model_name=engine.model_name, max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size, eos_token_ids=list(engine.eos_token_ids),
            dtype=self.dtype, device=self.device)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        core = self.core
        info = pb.GetServerInfoResponse(
            version=__version__, state=core.health().state, num_in_flight=core.num_in_flight,
            max_num_seqs=core.max_num_seqs, max_waiting=core.max_waiting,
            uptime_s=_uptime(core))
        s = core.engine_stats()
        if s is not None:
            info.num_running, info.num_waiting = s.num_running, s.num_waiting
            info.num_kv_blocks, info.num_free_kv_blocks = s.num_kv_blocks, s.num_free_kv_blocks
        return info


    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        """Whose a request is (``megaserve.server.auth``): the API key the call presents
        where the server has keys, else the connection (peer address and port) that
        started it. Request ids are scoped by owner: only the owner can abort them."""
        if self.api_keys:
            key = matching_key(_authorization(context.invocation_metadata()), self.api_keys)
            if key is not None:
                return identity(key)
        return f"grpc:{context.peer()}"


def _authorization(metadata) -> str:
    """The ``authorization`` metadata value of a call ("" without one)."""
    given = dict(metadata or ()).get("authorization", "")
    return given.decode("latin-1") if isinstance(given, bytes) else given


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for Generation calls without ``authorization: Bearer <key>``."""

    def __init__(self, api_keys: tuple[str, ...]) -> None:
        self._api_keys = api_keys

        async def refuse(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "authorization: missing or wrong API key (send the metadata "
                                "'authorization: Bearer <key>')")

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
            details: grpc.HandlerCallDetails):
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)  # health, reflection
        if matching_key(_authorization(details.invocation_metadata), self._api_keys):
            return await continuation(details)
        return self._refuse_stream if details.method.endswith("/Generate") \
            else self._refuse_unary


def _uptime(core: ServingCore) -> float:
    return time.monotonic() - core.started_at


def _input_field(request: pb.GenerateRequest) -> str:
    return "token_ids" if request.WhichOneof("input") == "token_ids" else "text"


def _chunk(delta: Delta) -> pb.Chunk:
    return pb.Chunk(token_ids=delta.token_ids, text=delta.text,
                    logprobs=logprobs_to_proto(delta.token_ids, delta.logprobs))


def _complete(request_id: str, delta: Delta) -> pb.Complete:
    usage = pb.Usage(prompt_tokens=delta.prompt_tokens, completion_tokens=len(delta.output_ids),
                     cached_tokens=delta.cached_tokens)
    return pb.Complete(request_id=request_id, output_ids=delta.output_ids,
                       text=delta.output_text, finish_reason=delta.finish_reason, usage=usage,
                       logprobs=logprobs_to_proto(delta.output_ids, delta.output_logprobs))


def _handlers(service: GenerationService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=deserialize_generate,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            service.Abort, request_deserializer=safe_deserializer(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo,
            request_deserializer=safe_deserializer(pb.GetModelInfoRequest),
            response_serializer=pb.GetModelInfoResponse.SerializeToString),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            service.GetServerInfo,
            request_deserializer=safe_deserializer(pb.GetServerInfoRequest),
            response_serializer=pb.GetServerInfoResponse.SerializeToString),
    })


def _health_handlers(servicer: health.aio.HealthServicer) -> grpc.GenericRpcHandler:
    """``grpc.health.v1.Health`` as ``add_HealthServicer_to_server`` registers it, but
    bytes that are not a HealthCheckRequest get INVALID_ARGUMENT (not UNKNOWN)."""
    parse = safe_deserializer(health_pb2.HealthCheckRequest)

    async def check(request, context):
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        return await servicer.Check(request, context)

    async def watch(request, context):
        if isinstance(request, BadMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)
        async for response in servicer.Watch(request, context):
            yield response

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(health.SERVICE_NAME, {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=parse, response_serializer=serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=parse, response_serializer=serialize),
    })


def build_grpc_server(service: GenerationService, address: str,
                      api_key: str | tuple[str, ...] | None = None,
                      ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Creates (does not start) the grpc.aio server bound to ``address`` ("host:port").

    With ``api_key``, Generation calls need ``authorization: Bearer <api_key>`` metadata.

    Health starts NOT_SERVING for both the overall and the service name; the caller flips
    it with ``set_health``. Raises RuntimeError if the port cannot be bound.
    """
    keys = normalize_keys(api_key)
    service.api_keys = keys
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys else [],
                             options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    server.add_generic_rpc_handlers((_handlers(service),))
    health_servicer = _HealthServicer(service.core)
    server.add_generic_rpc_handlers((_health_handlers(health_servicer),))
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot bind gRPC to {address}")
    return server, health_servicer


class _HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 as set by ``set_health``, plus ``LIVENESS_NAME`` (megaserve.service),
    answered from the server's state: NOT_SERVING only once it has FAILED."""

    def __init__(self, core: ServingCore) -> None:
        super().__init__()
        self._core = core

    async def Check(self, request: health_pb2.HealthCheckRequest, context
                    ) -> health_pb2.HealthCheckResponse:
        if request.service == LIVENESS_NAME:
            failed = self._core.state is ServerState.FAILED
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.NOT_SERVING if failed
                else health_pb2.HealthCheckResponse.SERVING)
        return await super().Check(request, context)


async def set_health(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Sets overall ("") and readiness (the service name) health together."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
