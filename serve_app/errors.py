"""The one error type of the HTTP API: `APIError` carries an HTTP status and the OpenAI error body.

Everything the ingress rejects (a bad field, an unknown model, an overloaded engine) is raised as an
APIError at the point that knows why; the ingress turns it into a response with `.body()` as JSON,
`.status` and `.headers`. No Ray or FastAPI here: the validation code and its tests use it as is.
Messages may quote the request (a model name, a field's value): their text is made valid Unicode when
the error is made (a lone surrogate becomes its escape, e.g. `\\ud800`), so writing the body as UTF-8 cannot fail.
"""

from __future__ import annotations

from typing import Literal

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
    "overloaded_error",
]


class APIError(Exception):
    """An HTTP error answer in OpenAI's shape. `param` names the offending request field (None when no
    single field is at fault); `code` is OpenAI's machine-readable code where it has one."""

    def __init__(
        self,
        status: int,
        message: str,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _as_text(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else _as_text(param)
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}, OpenAI's error schema."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "invalid or missing API key") -> APIError:
    return APIError(401, message, "authentication_error", code="invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", param, code)


def model_not_found(name: str) -> APIError:
    """OpenAI answers an unknown model with 404, type invalid_request_error, code model_not_found."""
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def payload_too_large(message: str) -> APIError:
    return APIError(413, message, "invalid_request_error")


def rate_limited(message: str, retry_after_s: int | None = None) -> APIError:
    return APIError(429, message, "rate_limit_error", headers=_retry_after(retry_after_s))


def server_error(message: str = "internal server error") -> APIError:
    return APIError(500, message, "server_error")


def overloaded(message: str, retry_after_s: int | None = None) -> APIError:
    """503: the service cannot take the request now (engine not ready, queue full)."""
    return APIError(503, message, "overloaded_error", headers=_retry_after(retry_after_s))


def _as_text(text: str) -> str:
    """text with every lone surrogate (the only code points UTF-8 cannot encode) written as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _retry_after(retry_after_s: int | None) -> dict[str, str]:
    return {} if retry_after_s is None else {"Retry-After": str(max(0, int(retry_after_s)))}
