r"""What OpenAI's two APIs the proxy serves share: Chat Completions
(:mod:`~qwengyre.proxy.openai_api`) and Responses (:mod:`~qwengyre.proxy.responses_api`),
whose dialects are :class:`OpenAIDialect`\ s.

Pure functions, no I/O: reading a body and validating it with OpenAI's wording of a
bad parameter (``Invalid type for 'messages[0].content': expected ..., but got ...``,
``param`` = the field's path), the ``x-*`` headers request-class rules may read, text
content parts, tool-call arguments, stop strings, a token's log-prob as JSON, the
``{"error": {...}}`` shape with its status and retry headers, the context-too-long
error and the models listing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import ValidationError

from qwengyre.proxy import jsonsafe
from qwengyre.proxy.dialect import Dialect, ErrorAnswer, select_headers
from qwengyre.proxy.jsonsafe import StrictModel
from qwengyre.proxy.types import ApiError, ChatRequest, TokenLogprob, ToolCall

# Substrings of header names that carry credentials; such headers never reach ChatRequest.
_CREDENTIAL_HEADER_PARTS = (
    "authorization",
    "api-key",
    "apikey",
    "auth",
    "token",
    "secret",
    "password",
    "credential",
    "cookie",
)

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for per token (none are listed)."""

UNSUPPORTED_PARTS = {
    "image_url": "image",
    "image": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "file": "file",
    "input_file": "file",
}
"""Content part types the served (text-only) model cannot take, and what they carry."""


# ---------------------------------------------------------------------------------------
# Errors in requests
# ---------------------------------------------------------------------------------------


def json_type(value: object) -> str:
    """``value``'s JSON type as OpenAI's messages name it (``an integer``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def invalid(param: str | None, message: str) -> ApiError:
    """A 400 ``invalid_request_error`` about ``param`` (None: the body as a whole)."""
    return ApiError("invalid_request_error", message, param=param)


def type_error(param: str, expected: str, value: object) -> ApiError:
    """``param`` holds ``value``, which is not ``expected`` (``an object``, ...)."""
    return invalid(
        param,
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
    )


def missing(param: str) -> ApiError:
    """``param`` is required and absent."""
    return invalid(param, f"Missing required parameter: '{param}'.")


_EXPECTED_BY_ERROR_TYPE = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "an array",
}


def _from_validation_error(err: ValidationError, prefix: tuple[str | int, ...] = ()) -> ApiError:
    """The first pydantic error as an OpenAI-style invalid_request_error."""
    first = err.errors(include_url=False)[0]
    param = _path((*prefix, *first["loc"]))
    kind = first["type"]
    value = first.get("input")
    ctx = first.get("ctx") or {}
    if kind == "missing":
        return missing(param)
    if kind in _EXPECTED_BY_ERROR_TYPE:
        return type_error(param, _EXPECTED_BY_ERROR_TYPE[kind], value)
    if kind == "literal_error":
        return invalid(
            param,
            f"Invalid value for '{param}': got {json.dumps(value)}, "
            f"expected {ctx.get('expected')}.",
        )
    if kind == "too_short" and isinstance(value, list):
        return invalid(
            param,
            f"Invalid value for '{param}': expected an array with at least "
            f"{ctx.get('min_length', 1)} item(s), but got an empty array.",
        )
    if kind == "string_too_short":
        return invalid(param, f"Invalid value for '{param}': expected a non-empty string.")
    bounds = {
        "greater_than": "greater than",
        "greater_than_equal": "greater than or equal to",
        "less_than": "less than",
        "less_than_equal": "less than or equal to",
    }
    if kind in bounds:
        limit = next(iter(ctx.values()), None)
        return invalid(
            param,
            f"Invalid value for '{param}': {json.dumps(value)} is out of range; "
            f"it must be {bounds[kind]} {limit}.",
        )
    return invalid(param, f"Invalid value for '{param}': {first['msg']}.")


def validate(model: type[StrictModel], data: object, prefix: tuple[str | int, ...] = ()) -> Any:
    """``data`` as ``model``; its first error as an ``invalid_request_error`` whose
    ``param`` is the field's path below ``prefix``."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _from_validation_error(err, prefix) from None


# ---------------------------------------------------------------------------------------
# Reading requests
# ---------------------------------------------------------------------------------------


def load_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, read by :func:`qwengyre.proxy.jsonsafe.load_object`
    (bounded depth, no NaN/Infinity, lone surrogates replaced); anything else is a 400
    with ``param`` null."""
    try:
        return jsonsafe.load_object(body)
    except jsonsafe.TooDeep as err:
        raise invalid(None, f"The JSON body of the request is too deep: {err}.") from None
    except jsonsafe.NotAnObject as err:
        raise invalid(
            None,
            f"The request body must be a JSON object, but got {json_type(err.value)} instead.",
        ) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise invalid(
            None,
            f"Could not parse the JSON body of the request ({err}). "
            "The body must be a JSON object encoded as UTF-8.",
        ) from None


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The ``x-*`` headers request-class rules may read (credentials left out)."""
    return select_headers(
        headers,
        prefixes=("x-",),
        secret_words=_CREDENTIAL_HEADER_PARTS,
        not_utf8="The header {name} is not valid UTF-8.",
    )


def text_parts(value: list[Any], param: str, allowed: tuple[str, ...]) -> str:
    """A list of content parts whose types are ``allowed`` (a ``refusal`` part's text is
    its ``refusal``, any other's its ``text``), joined with a newline, as vLLM's OpenAI
    server does, so a system prompt split into parts does not run its sentences
    together. Media parts are refused: the served model takes text only."""
    texts: list[str] = []
    for j, part in enumerate(value):
        pparam = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise type_error(pparam, "an object", part)
        ptype = part.get("type")
        if not isinstance(ptype, str):
            if "type" not in part:
                raise missing(f"{pparam}.type")
            raise type_error(f"{pparam}.type", "a string", ptype)
        if ptype in UNSUPPORTED_PARTS:
            raise invalid(
                f"{pparam}.type",
                f"Invalid value for '{pparam}.type': '{ptype}' parts are not supported; "
                f"the served model takes text only ({UNSUPPORTED_PARTS[ptype]} input is "
                f"refused). Send the content as a string or as '{allowed[0]}' parts.",
            )
        if ptype not in allowed:
            raise invalid(
                f"{pparam}.type",
                f"Invalid value for '{pparam}.type': got {json.dumps(ptype)}, expected "
                + " or ".join(f"'{a}'" for a in allowed)
                + ".",
            )
        key = "refusal" if ptype == "refusal" else "text"
        text = part.get(key)
        if not isinstance(text, str):
            if key not in part:
                raise missing(f"{pparam}.{key}")
            raise type_error(f"{pparam}.{key}", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def tool_arguments(value: object, param: str, where: str) -> dict[str, Any]:
    """A tool call's ``arguments`` (a string holding a JSON object, an object, or
    empty) as an object; ``where`` names the call's message in errors."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise type_error(param, "a string holding a JSON object", value)
    if not value.strip():
        return {}
    try:
        parsed = jsonsafe.loads(value, surrogates="replace")
    except ValueError as err:  # not JSON, NaN/Infinity, or too deep
        raise invalid(
            param,
            f"Invalid value for '{param}': the tool call arguments of {where} are "
            f"not valid JSON ({err}); 'arguments' must be a JSON object encoded as a string.",
        ) from None
    if not isinstance(parsed, dict):
        raise invalid(
            param,
            f"Invalid value for '{param}': the tool call arguments of {where} "
            f"encode {json_type(parsed)}, but they must encode a JSON object.",
        )
    return parsed


def parse_stop(value: object) -> tuple[str, ...]:
    """``stop``: a string or an array of strings (empty strings stop nothing)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if not isinstance(value, list):
        raise type_error("stop", "a string or an array of strings", value)
    out: list[str] = []
    for j, s in enumerate(value):
        if not isinstance(s, str):
            raise type_error(f"stop[{j}]", "a string", s)
        if s:  # an empty stop string stops nothing
            out.append(s)
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------


def token_logprob(t: TokenLogprob) -> dict[str, Any]:
    """One sampled token's log-prob entry (no alternatives: ``top_logprobs`` empty)."""
    return {
        "token": t.token,
        "logprob": t.logprob,
        "bytes": list(t.token.encode("utf-8", "replace")),
        "top_logprobs": [],
    }


def arguments_json(tc: ToolCall) -> str:
    """A tool call's arguments as the JSON string both APIs carry."""
    return json.dumps(tc.arguments, ensure_ascii=False)


# ApiError kind -> (OpenAI error type, default code). The SDK picks its exception class
# from the HTTP status alone (400 BadRequestError, 401 AuthenticationError, 403
# PermissionDeniedError, 404 NotFoundError, 429 RateLimitError, >=500
# InternalServerError); type and code are informational.
_OPENAI_ERRORS: dict[str, tuple[str, str | None]] = {
    "invalid_request_error": ("invalid_request_error", None),
    "authentication_error": ("authentication_error", "invalid_api_key"),
    "permission_error": ("permission_error", None),
    "not_found_error": ("not_found_error", None),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit_error": ("rate_limit_exceeded", "rate_limit_exceeded"),
    "api_error": ("server_error", None),
    "overloaded_error": ("server_error", "overloaded"),
}


def error_status(e: ApiError) -> int:
    """HTTP status for ``e``; Anthropic's 529 ``overloaded_error`` answers 503 here."""
    if e.kind == "overloaded_error":
        return 503
    return e.status


def error_headers(e: ApiError) -> dict[str, str]:
    """``retry-after`` (whole seconds, rounded up) and ``retry-after-ms`` (which the
    ``openai`` SDK prefers) when ``e`` says when to retry."""
    if e.retry_after_s is None or not math.isfinite(e.retry_after_s):
        return {}
    seconds = max(0.0, e.retry_after_s)
    return {"retry-after": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1000))}


def error_object(e: ApiError) -> dict[str, Any]:
    """``{"message", "type", "param", "code"}``: the inside of :func:`error_body`."""
    etype, default_code = _OPENAI_ERRORS.get(e.kind, ("server_error", None))
    return {
        "message": e.message,
        "type": etype,
        "param": e.param,
        "code": e.code if e.code is not None else default_code,
    }


def error_body(e: ApiError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` in OpenAI's shape."""
    return {"error": error_object(e)}


def context_length_exceeded(tokens: int, limit: int, param: str = "messages") -> ApiError:
    """The error OpenAI answers when prompt + completion budget exceed the context
    (``param``: the field holding the conversation)."""
    return ApiError(
        "invalid_request_error",
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {tokens} tokens. Please reduce the length of the messages.",
        code="context_length_exceeded",
        param=param,
    )


def models_body(model_ids: list[str], created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {
        "object": "list",
        "data": [
            {"id": mid, "object": "model", "created": created, "owned_by": "qwengyre"}
            for mid in model_ids
        ],
    }


class OpenAIDialect(Dialect):
    """A dialect of OpenAI's: bodies read by :func:`load_body`, errors and the models
    listing in OpenAI's shapes, its conversation field (``conversation_param``) named
    in the context-too-long error."""

    conversation_param: ClassVar[str]

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ChatRequest:
        return self.parse_doc(load_body(body), headers, None)

    def error(self, e: ApiError) -> ErrorAnswer:
        return ErrorAnswer(error_status(e), error_body(e), error_headers(e))

    def context_too_long(self, tokens: int, limit: int) -> ApiError:
        return context_length_exceeded(tokens, limit, param=self.conversation_param)

    def models_body(self, model: str) -> dict[str, Any]:
        return models_body([model], int(time.time()))
