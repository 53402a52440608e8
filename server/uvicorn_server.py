"""uvicorn's server with one change to its signal handling, so that every shutdown is clean."""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from jaxengine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A second SIGINT/SIGTERM aborts the in-flight requests at once (their clients still get a
    last chunk with finish_reason "abort") instead of uvicorn's force-quit, which cancels
    handlers mid-flight and logs their stack traces."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            logger.info("second signal: aborting in-flight requests now")
            self.engine.hurry_shutdown()
            return
        super().handle_exit(sig, frame)
