"""The draft service's edge: protobuf <-> dataclasses, with request validation."""

from __future__ import annotations

from dataclasses import dataclass

from specd.loop import DraftReply, SyncPoint
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


def propose_call(msg: draft_pb2.ProposeRequest) -> ProposeCall:
    if not 1 <= msg.k <= common.MAX_K:
        raise ValueError(f"k must be in [1, {common.MAX_K}]")
    return ProposeCall(
        common.session_id(msg.session_id), common.sync_from_proto(msg.sync), msg.k, common.params_from_proto(msg.sampling)
    )


def propose_request(session_id: str, sync: SyncPoint, k: int, params: SamplingParams) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        session_id=session_id, sync=common.sync_to_proto(sync), k=k, sampling=common.params_to_proto(params)
    )


def propose_response(
    proposal: Proposal, position: int, instance_id: str, compute_s: float
) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        tokens=proposal.tokens,
        q=common.dists_to_proto(proposal.q),
        position=position,
        instance_id=instance_id,
        compute_s=compute_s,
    )


def draft_reply(msg: draft_pb2.ProposeResponse) -> DraftReply:
    proposal = Proposal(tuple(msg.tokens), common.dists_from_proto(msg.q))
    return DraftReply(proposal, msg.position, msg.instance_id, msg.compute_s)
