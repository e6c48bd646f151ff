"""HTTP client for SGLang servers and for glm5-core's own :class:`~glm5_core.rl.serving.server.EngineServer`
(stdlib only).

Only loopback hosts (127.0.0.0/8, ``localhost``, ``[::1]``) are accepted unless the caller lists the URL
explicitly (``allow_remote=True``, what ``rollout.engine_urls`` / ``--engine-url`` do). ``api_key`` is sent as
``Authorization: Bearer KEY``, SGLang's ``--api-key`` convention. Bodies are read as SGLang writes them: JSON
for most routes, plain text for ``/flush_cache``, empty for ``/health``; errors as ``{"error": str}``,
``{"error": {"message": str}}`` or the ``ErrorResponse`` shape ``{"message": str, "code": int}``.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional

from glm5_core.rl.config import check_engine_url, is_loopback  # noqa: F401 (importable here too)


class EngineUnavailable(RuntimeError):
    """The engine did not answer (connection refused / reset, timeout): the caller may retry elsewhere."""


class EngineRequestError(RuntimeError):
    """The engine answered with an error status. ``retry_after`` (seconds, from the ``Retry-After`` header) is
    set when the server was only too busy to take the request: the same request may be sent again later."""

    def __init__(self, status: int, message: str, retry_after: Optional[float] = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after

    @property
    def busy(self) -> bool:
        return self.status == 503 and self.retry_after is not None


class GenerationAborted(EngineUnavailable):
    """The engine ended the request with ``finish_reason`` abort (SGLang's ``/pause_generation`` in its default
    ``abort`` mode aborts every request, e.g. for a weight push). ``response`` holds what it returned: the tokens
    sampled before the abort, with their log-probs and versions, which a continuation request extends."""

    def __init__(self, message: str, response: dict):
        super().__init__(message)
        self.response = response


class MalformedResponse(ValueError):
    """An engine answered 200 with something no correct engine sends (missing or impossible log-probs, tokens
    outside the vocabulary, an unknown or future weight version ...). ``server`` names the engine (its URL).
    The rollout it belonged to is dropped; the run goes on."""

    def __init__(self, message: str, server: str = ""):
        super().__init__(f"{server}: {message}" if server else message)
        self.server = server
        self.reason = message


def _retry_after(headers) -> Optional[float]:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def error_message(raw: bytes, fallback: str) -> str:
    """The message of an error body in any of SGLang's shapes (or the raw text, or ``fallback``)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace").strip()
        return text[:500] or fallback
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


def is_fleet_failure(exc: BaseException) -> bool:
    """The engines could not serve the request (unreachable, failed, timed out: 5xx), as opposed to the request's
    own fault (4xx, a bug on the caller's side that every replica would answer the same way)."""
    return isinstance(exc, EngineUnavailable) or (isinstance(exc, EngineRequestError) and exc.status >= 500)


DEFAULT_TIMEOUT_S = 630.0  # above the server's request_timeout (600 s): a slow request comes back as its 504


class EngineClient:
    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S, *, api_key: Optional[str] = None,
                 allow_remote: bool = False):
        self.url = check_engine_url(url, allow_remote=allow_remote)
        self.timeout = timeout
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _raw(self, method: str, route: str, payload: Optional[dict] = None, timeout: Optional[float] = None) -> bytes:
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(self.url + route, data=data, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            try:
                raw = exc.read()
            except Exception:
                raw = b""
            raise EngineRequestError(exc.code, error_message(raw, str(exc.reason)), _retry_after(exc.headers)) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise EngineUnavailable(f"{self.url}{route}: {exc}") from None

    def _call(self, method: str, route: str, payload: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        raw = self._raw(method, route, payload, timeout)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise EngineUnavailable(f"{self.url}{route}: expected a JSON body, got {raw[:80]!r}") from None

    def generate(self, request: dict) -> dict:
        response = self._call("POST", "/generate", request)
        if not isinstance(response, dict) or not isinstance(response.get("meta_info"), dict):
            raise EngineUnavailable(f"{self.url}/generate: expected a JSON object with meta_info")
        reason = response["meta_info"].get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise GenerationAborted(f"{self.url}: request {request.get('rid')} aborted ({reason.get('message')})",
                                    response)
        return response

    def update_weights_from_disk(self, path: str, version: Any, *, flush_cache: bool = True) -> dict:
        return self._call("POST", "/update_weights_from_disk", {
            "model_path": path, "weight_version": str(version), "flush_cache": flush_cache})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: Optional[float] = None) -> dict:
        return self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout=timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, version: Any, *, flush_cache: bool = True,
                                        timeout: Optional[float] = None) -> dict:
        return self._call("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": str(version)}, timeout=timeout)

    def begin_weight_update(self, timeout: Optional[float] = None) -> dict:
        """sglang 0.5.23's weight-update session (``BeginWeightUpdateReqInput``); older servers answer 404."""
        return self._call("POST", "/begin_weight_update", {}, timeout=timeout)

    def end_weight_update(self, timeout: Optional[float] = None) -> dict:
        return self._call("POST", "/end_weight_update", {}, timeout=timeout)

    def destroy_weights_update_group(self, group_name: str, timeout: Optional[float] = None) -> dict:
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._call("POST", "/continue_generation", {})

    def flush_cache(self) -> str:
        """SGLang answers plain text (200, or 400 while requests run: ``EngineRequestError``)."""
        return self._raw("POST", "/flush_cache").decode("utf-8", "replace")

    def end_trajectories(self, rids: list[str], timeout: Optional[float] = None) -> dict:
        """glm5-core's own route (SGLang has none: it answers 404, which callers treat as nothing to free)."""
        return self._call("POST", "/end_trajectories", {"rids": list(rids)}, timeout=timeout)

    def info(self, timeout: float = 10.0) -> dict:
        return self._call("GET", "/get_server_info", timeout=timeout)

    def health(self, timeout: float = 2.0) -> bool:
        """True when the engine serves: ``/health`` answers 200 (SGLang's body is empty), or it is alive but at
        its connection cap (a busy 503 with ``Retry-After``). False when it does not answer or reports a failed
        engine (503)."""
        try:
            self._raw("GET", "/health", timeout=timeout)
            return True
        except EngineRequestError as exc:
            return exc.busy
        except EngineUnavailable:
            return False
