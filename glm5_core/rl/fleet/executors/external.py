"""Engines glm5 rl did not start: SGLang servers or ``glm5 serve`` processes at listed URLs
(``rollout.engine_urls`` / ``--engine-url``).

The executor only names them: ``start`` returns the URL, nothing is spawned, ``shutdown`` leaves them running.
An engine that stops answering is taken off the ring by the replica set and put back once its ``/health``
answers again; ``restart`` cannot bring it back and says so (the supervisor logs it and retries with backoff).
"""
from __future__ import annotations

from glm5_core.rl.serving.client import check_engine_url


class ExternalEngines:
    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("rollout.engine_urls: expected at least one http://HOST:PORT address")
        self.urls: dict[str, str] = {}
        for i, url in enumerate(urls):
            checked = check_engine_url(url, allow_remote=True, where=f"rollout.engine_urls[{i}]")
            if checked in self.urls.values():
                raise ValueError(f"rollout.engine_urls[{i}]: {checked} is listed twice")
            self.urls[f"engine{i}"] = checked

    @property
    def names(self) -> list[str]:
        return list(self.urls)

    def start(self, name: str) -> str:
        return self.urls[name]

    def is_alive(self, name: str) -> bool:
        return name in self.urls  # liveness is the replica set's health check; there is no process to watch

    def restart(self, name: str) -> str:
        raise RuntimeError(f"{name} ({self.urls[name]}) is not healthy; glm5 rl does not manage external engines: "
                           "it is used again once its /health answers")

    def shutdown(self) -> None:
        return None
