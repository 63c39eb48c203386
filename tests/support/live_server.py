"""A live uvicorn server in a background thread, on 127.0.0.1 and a free port.

``with LiveServer(create_app(settings)) as srv: httpx.get(srv.url + "/readyz")``.
Startup failures raise in ``__enter__``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.support.ports import free_port


class LiveServer:
    def __init__(
        self, app: Any, port: int | None = None, startup_timeout: float = 60.0, **config: Any
    ) -> None:
        import uvicorn

        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        config.setdefault("log_level", "warning")
        config.setdefault("access_log", False)
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="on", **config)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # noqa: BLE001 - reported by __enter__
            self.error = e

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError("server did not start in time")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
