"""Typed request errors shared by the gRPC and HTTP front ends."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Why a request failed; each code maps to one gRPC status and one HTTP status."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400)
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401)
    PERMISSION_DENIED = ("PERMISSION_DENIED", 403)
    NOT_FOUND = ("NOT_FOUND", 404)
    ALREADY_EXISTS = ("ALREADY_EXISTS", 409)
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429)
    TIMEOUT = ("DEADLINE_EXCEEDED", 408)  # the client was too slow to send its request
    TOO_LARGE = ("RESOURCE_EXHAUSTED", 413)  # a message / body over the transport limit
    UNAVAILABLE = ("UNAVAILABLE", 503)
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504)
    INTERNAL = ("INTERNAL", 500)

    @property
    def grpc_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        """The ``error.type`` string of an OpenAI-style error body."""
        return {
            ErrorCode.INVALID_ARGUMENT: "invalid_request_error",
            ErrorCode.UNAUTHENTICATED: "authentication_error",
            ErrorCode.PERMISSION_DENIED: "permission_error",
            ErrorCode.TIMEOUT: "timeout",
            ErrorCode.NOT_FOUND: "not_found_error",
            ErrorCode.ALREADY_EXISTS: "invalid_request_error",
            ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_error",
            ErrorCode.TOO_LARGE: "invalid_request_error",
            ErrorCode.UNAVAILABLE: "service_unavailable",
            ErrorCode.DEADLINE_EXCEEDED: "timeout",
            ErrorCode.INTERNAL: "internal_error",
        }[self]


class RequestError(Exception):
    """A request the server refuses or could not finish.

    ``message`` is meant for the client: for bad input it starts with the offending field
    (``"max_tokens: must be ..."``) so a client can tell which argument to fix. ``param`` is
    that field name when there is one.
    """

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @classmethod
    def invalid(cls, param: str, problem: str) -> RequestError:
        """An INVALID_ARGUMENT error whose message is ``"<param>: <problem>"``."""
        return cls(ErrorCode.INVALID_ARGUMENT, f"{param}: {problem}", param=param)

    @classmethod
    def from_value_error(cls, err: ValueError, default_param: str = "request") -> RequestError:
        """Wraps an engine / SamplingParams ValueError, keeping its field name first.

        Engine messages start with ``"<field>: "``; SamplingParams messages start with
        ``"<field> must ..."``. Either way the field name becomes ``param``.
        """
        text = str(err)
        head = text.split(":", 1)[0].split(" ", 1)[0].strip()
        if head and head.replace("_", "").isalnum():
            param = head
            if text.startswith(f"{head}:"):
                message = text
            elif text.startswith(f"{head} "):  # "top_p must be ..." → "top_p: must be ..."
                message = f"{head}: {text[len(head) + 1:]}"
            else:
                message = f"{head}: {text}"
        else:
            param = default_param
            message = f"{default_param}: {text}"
        return cls(ErrorCode.INVALID_ARGUMENT, message, param=param)
