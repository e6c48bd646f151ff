"""HTTP reward-model client: ``reward: {url: http://HOST:PORT/score, ...}``.

Each finished trajectory is one ``POST`` of its reward input (JSON, see ``rewards.reward_input``); the
server answers ``{"reward": <finite number>}``. The server is untrusted: the answer is read up to
``max_response_bytes`` (more is a failure, not a bigger allocation), must be that JSON object, and a whole
attempt (connect + reply) is bounded by ``timeout_s``. Connection errors, time-outs, HTTP 429 and 5xx are
retried ``retries`` times with exponential backoff (``backoff_s``, doubling); any other status, a redirect,
a malformed or oversized body is not (it would come back the same). What a failure does is the caller's
policy (``rewards.RewardScorer``): this client raises :class:`RewardRequestError`.
"""
from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Optional

DEFAULT_MAX_RESPONSE_BYTES = 1 << 16
RETRIED_STATUSES = (429, 500, 502, 503, 504)


class RewardRequestError(RuntimeError):
    """The reward server gave no usable reward (after the retries a transient failure gets)."""


def check_reward_url(url: Any, key: str = "reward.url") -> str:
    """``url`` if it is ``http(s)://HOST[:PORT][/path]`` (no credentials, no fragment); ValueError naming
    ``key`` otherwise."""
    if not isinstance(url, str):
        raise ValueError(f"{key}: expected an http:// or https:// URL, got {url!r:.80}")
    parsed = urllib.parse.urlsplit(url)
    try:
        _ = parsed.port  # parsing the port is the check
    except ValueError:
        raise ValueError(f"{key}: expected a port in 1..65535, got {url!r:.80}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{key}: expected an http:// or https:// URL with a host, got {url!r:.80}")
    if parsed.username is not None or parsed.password is not None or parsed.fragment:
        raise ValueError(f"{key}: expected no credentials or fragment in the URL (use reward.api_key), "
                         f"got {url!r:.80}")
    return url


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # a 3xx surfaces as an HTTPError: a reward server that redirects is misconfigured


def parse_reward(body: bytes) -> float:
    """The reward of a server's answer ``{"reward": number}``; RewardRequestError for anything else."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RewardRequestError(f"malformed reply (not JSON: {exc}): {body[:80]!r}") from None
    value = data.get("reward") if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardRequestError(f"malformed reply: expected {{\"reward\": <finite number>}}, got {body[:80]!r}")
    return float(value)


class HttpRewardClient:
    """``client(payload) -> float``: one reward per call, thread-safe (no shared connection)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.5,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, api_key: Optional[str] = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.url = check_reward_url(url)
        for name, value, zero_ok in (("timeout_s", timeout_s, False), ("backoff_s", backoff_s, True)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"{name}: expected a finite number {'>=' if zero_ok else '>'} 0, got {value!r}")
        for name, value, low in (("retries", retries, 0), ("max_response_bytes", max_response_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError(f"api_key: expected a non-empty string or null, got {api_key!r:.20}")
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), retries, float(backoff_s)
        self.max_response_bytes = max_response_bytes
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._sleep = sleep
        self._opener = urllib.request.build_opener(_NoRedirect)

    def _read_bounded(self, response, deadline: float) -> bytes:
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                raise socket.timeout(f"reply not complete within {self.timeout_s:g} s")
            chunk = response.read(min(8192, self.max_response_bytes + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_response_bytes:
                raise RewardRequestError(f"reply larger than max_response_bytes={self.max_response_bytes}")

    def _attempt(self, data: bytes) -> float:
        request = urllib.request.Request(self.url, data=data, headers=self._headers, method="POST")
        deadline = time.monotonic() + self.timeout_s
        with self._opener.open(request, timeout=self.timeout_s) as response:
            return parse_reward(self._read_bounded(response, deadline))

    def __call__(self, payload: dict[str, Any]) -> float:
        data = json.dumps(payload).encode("utf-8")
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._attempt(data)
            except urllib.error.HTTPError as exc:
                exc.close()
                last = f"HTTP {exc.code}"
                if exc.code not in RETRIED_STATUSES:
                    break
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            except RewardRequestError as exc:
                last = str(exc)
                break
        raise RewardRequestError(f"reward server {self.url}: {last} (after {attempt + 1} attempt(s))")
