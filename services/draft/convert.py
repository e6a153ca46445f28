"""The draft service's edge: protobuf <-> dataclasses, with request validation."""

from __future__ import annotations

from dataclasses import dataclass

from specd.loop import DraftReply, SyncPoint
from specd.policy import PolicyConfig
from specd.sampling import SamplingParams
from specd.verify import Proposal
from services.common import convert as common
from services.protogen.specd.v1 import draft_pb2


@dataclass(frozen=True)
class ProposeCall:
    session_id: str
    sync: SyncPoint
    k: int
    params: SamplingParams
    lookahead: int = 0
    min_confidence: float = 0.0


def propose_call(msg: draft_pb2.ProposeRequest) -> ProposeCall:
    if not 1 <= msg.k <= common.MAX_K:
        raise ValueError(f"k must be in [1, {common.MAX_K}]")
    if msg.lookahead > msg.k + 1:
        raise ValueError(f"lookahead must be in [0, k + 1], got {msg.lookahead} with k = {msg.k}")
    PolicyConfig(min_confidence=msg.min_confidence).validate()  # in [0, 1), not NaN
    return ProposeCall(
        common.session_id(msg.session_id), common.sync_from_proto(msg.sync), msg.k,
        common.params_from_proto(msg.sampling), msg.lookahead, msg.min_confidence,
    )


def propose_request(
    session_id: str, sync: SyncPoint, k: int, params: SamplingParams, lookahead: int = 0, min_confidence: float = 0.0
) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        session_id=session_id, sync=common.sync_to_proto(sync), k=k, sampling=common.params_to_proto(params),
        lookahead=lookahead, min_confidence=min_confidence,
    )


def propose_response(reply: DraftReply) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        tokens=reply.proposal.tokens,
        q=common.dists_to_proto(reply.proposal.q),
        position=reply.position,
        instance_id=reply.instance_id,
        compute_s=reply.compute_s,
        reused=reply.reused,
        queued_s=reply.queued_s,
        sibling=reply.proposal.sibling,
    )


def draft_reply(msg: draft_pb2.ProposeResponse) -> DraftReply:
    proposal = Proposal(tuple(msg.tokens), common.dists_from_proto(msg.q), common.optional(msg, "sibling"))
    return DraftReply(proposal, msg.position, msg.instance_id, msg.compute_s, msg.reused, msg.queued_s)
