"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by route code; rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
