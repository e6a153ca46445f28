"""A coordinator-wide draft outage: while no draft replica answers, sessions decode plainly (the
target alone: the same tokens, only slower) instead of waiting, and one background probe asks
the pool until a replica answers again (docs/pools.md)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from specd.protocols import Drafter

DRAFT_TIMEOUT_S = 2.0  # a proposal slower than this counts as no draft replica answering
DRAFT_PROBE_S = 0.5  # while none answers, ask the pool again this often
log = logging.getLogger(__name__)


@dataclass
class DraftOutage:
    """Whether the draft pool answers, shared by a coordinator's sessions. A proposal that no
    replica answered within `timeout_s` starts an outage: rounds are plain target steps at once,
    and one background probe asks the pool every `probe_s` until a replica answers again."""

    timeout_s: float = DRAFT_TIMEOUT_S
    probe_s: float = DRAFT_PROBE_S
    down: bool = False
    outages: int = 0
    _probing: asyncio.Task | None = None

    def drafting(self, drafter: Drafter) -> bool:
        """May this round draft? (During an outage: no, and a probe is running.)"""
        if self.down and (self._probing is None or self._probing.done()):
            self._probing = asyncio.get_running_loop().create_task(self._probe(drafter))
        return not self.down

    def lost(self, error: BaseException) -> None:
        if not self.down:
            self.down, self.outages = True, self.outages + 1
            log.warning("no draft replica answers (%s): decoding plainly until one does", error or type(error).__name__)

    async def _probe(self, drafter: Drafter) -> None:
        while self.down:
            try:
                if await asyncio.wait_for(drafter.probe(), self.timeout_s):
                    self.down = False
                    log.info("a draft replica answers again: speculating")
                    return
            except Exception:  # noqa: BLE001 - any failure means: not yet
                pass
            await asyncio.sleep(self.probe_s)
