"""Graceful shutdown for `mtp serve`: uvicorn's server with a drain in front of its own.

On SIGTERM or Ctrl-C uvicorn stops accepting connections, closes idle keep-alive ones and waits for the rest; past
its `timeout_graceful_shutdown` it cancels the request tasks, which leaves clients with a plain-text 500 or a cut
stream and the log with CancelledError tracebacks. Here the app is told first (`Server.begin_drain`): after
`grace_s` it ends the generations still running itself, with OpenAI error objects (app.py), and only then would
uvicorn's own timeout, set `margin_s` later, fire - which it does not, as every request has answered by then.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

MARGIN_S = 5.0  # past the grace period, for the aborted requests to answer (and a chat template render to end)


class GracefulServer(uvicorn.Server):
    """`uvicorn.Server` that calls `begin_drain(grace_s)` (on the event loop) as it starts to shut down, and each
    of `cleanup` once it has (before the process exits)."""

    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[float], None], grace_s: float,
                 cleanup: tuple[Callable[[], None], ...] = ()):
        super().__init__(config)
        self.begin_drain, self.grace_s, self.cleanup = begin_drain, grace_s, cleanup

    async def shutdown(self, sockets=None) -> None:
        self.begin_drain(self.grace_s)
        try:
            await super().shutdown(sockets)
        finally:
            # uvicorn re-raises the signal it caught once serve() returns (so the process ends as a SIGTERM'd
            # one would): code after `run()` never runs, so the cleanup happens here
            for fn in self.cleanup:
                fn()
