"""The one error type of the HTTP API, converted once into OpenAI's error JSON at the edge."""

from __future__ import annotations

# HTTP status -> OpenAI's error "type"
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request the API refuses: HTTP status, a machine-readable code and a one-line message."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.code, self.message, self.param)


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    """`{"error": {"message", "type", "code", "param"}}` as OpenAI's API answers."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "code": code,
            "param": param,
        }
    }


def bad(code: str, message: str, param: str | None = None) -> ApiError:
    """A 400: the request is wrong in `param`."""
    return ApiError(400, code, message, param)
