"""What every client edge (gRPC today, REST too) shares: sessions with owners, and the loop.

Edges validate and convert; the frontend runs a request on a session and enforces that a
named session is only seen by the key that created it (anyone else gets "not found", so a
session id is not an oracle). Errors stay domain exceptions; each edge maps them to codes.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from specd.loop import Chunk, Finished, GenerationRequest, Services, generate
from specd.session import SessionNotFound, SessionState
from services.coordinator.convert import Limits
from services.coordinator.model_info import ModelInfo


class Frontend:
    def __init__(self, services: Services, model: ModelInfo, limits: Limits):
        self.services, self.model, self.limits = services, model, limits

    async def generate(
        self, request: GenerationRequest, session_id: str = "", owner: str = ""
    ) -> AsyncIterator[Chunk | Finished]:
        """Run a request; with a session id it continues (or starts) that session, else a one-off."""
        if session_id:
            await self._owned_or_absent(session_id, owner)
        named = session_id or uuid.uuid4().hex
        events = generate(request, named, self.services, self.model.decode, not session_id, owner=owner)
        async for event in events:
            yield event

    async def session(self, session_id: str, owner: str = "") -> SessionState:
        state = await self.services.store.get(session_id)
        if state is None or state.owner != owner:
            raise SessionNotFound(f"no session {session_id!r} (released, expired, or not yours)")
        return state

    async def release(self, session_id: str, owner: str = "") -> None:
        await self.session(session_id, owner)
        await self.services.store.delete(session_id)
        await self.services.drafter.release(session_id)
        await self.services.verifier.release(session_id)

    async def _owned_or_absent(self, session_id: str, owner: str) -> None:
        state = await self.services.store.get(session_id)
        if state is not None and state.owner != owner:
            raise SessionNotFound(f"no session {session_id!r} (released, expired, or not yours)")
