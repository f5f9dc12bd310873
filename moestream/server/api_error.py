"""The error the HTTP side answers with, in OpenAI's shape (Anthropic's on its Messages routes), and
the two 400s most checks raise.

Kept apart from the request and response models so that any part of the server can refuse a
request without pulling in pydantic's models. Never imports torch.
"""
from __future__ import annotations


class APIError(Exception):
    """An error that reaches the client in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same error as Anthropic's API shapes it: {"type": "error", "error": {type, message}}."""
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message}}


# Anthropic's error types by status (its SDKs pick the exception class by status; the type names the kind)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")
