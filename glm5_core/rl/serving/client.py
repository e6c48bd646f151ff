"""Minimal HTTP client for :class:`~glm5_core.rl.serving.server.EngineServer` (stdlib only)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional


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


def _retry_after(headers) -> Optional[float]:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def is_fleet_failure(exc: BaseException) -> bool:
    """The engines could not serve the request (unreachable, failed, timed out: 5xx), as opposed to the request's
    own fault (4xx, a bug on the caller's side that every replica would answer the same way)."""
    return isinstance(exc, EngineUnavailable) or (isinstance(exc, EngineRequestError) and exc.status >= 500)


DEFAULT_TIMEOUT_S = 630.0  # above the server's request_timeout (600 s): a slow request comes back as its 504


class EngineClient:
    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S):
        if not url.startswith("http://127.0.0.1:") and not url.startswith("http://localhost:"):
            raise ValueError(f"url: expected a local http://127.0.0.1:PORT address, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, route: str, payload: Optional[Dict] = None, timeout: Optional[float] = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(self.url + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", "")
            except Exception:
                message = exc.reason
            raise EngineRequestError(exc.code, message, _retry_after(exc.headers)) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise EngineUnavailable(f"{self.url}{route}: {exc}") from None

    def generate(self, request: Dict) -> Dict:
        response = self._call("POST", "/generate", request)
        if response["meta_info"]["finish_reason"]["type"] == "abort":
            raise EngineUnavailable(f"{self.url}: request {request.get('rid')} aborted")
        return response

    def update_weights_from_disk(self, path: str, version: int) -> Dict:
        return self._call("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": version})

    def end_trajectories(self, rids: List[str], timeout: Optional[float] = None) -> Dict:
        return self._call("POST", "/end_trajectories", {"rids": list(rids)}, timeout=timeout)

    def info(self, timeout: float = 10.0) -> Dict:
        return self._call("GET", "/get_server_info", timeout=timeout)

    def health(self, timeout: float = 2.0) -> bool:
        """True when the engine serves: it answers ``/health`` with ok, or it is alive but at its connection cap
        (a busy 503 with ``Retry-After``). False when it does not answer or reports a failed engine (503)."""
        try:
            return bool(self._call("GET", "/health", timeout=timeout).get("ok"))
        except EngineRequestError as exc:
            return exc.busy
        except EngineUnavailable:
            return False
