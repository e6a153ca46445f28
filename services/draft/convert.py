"""The draft service's edge: protobuf <-> contract dataclasses (specd/contracts.py), with
request validation."""

from __future__ import annotations

from specd.contracts import DraftReply, Proposal, ProposeRequest
from services.common import convert as common
from services.protogen.specd.v1 import draft_pb2


def propose_from_proto(msg: draft_pb2.ProposeRequest) -> ProposeRequest:
    return ProposeRequest(
        msg.session_id, common.sync_from_proto(msg.sync), msg.k, common.params_from_proto(msg.sampling),
        msg.min_confidence,
    ).validate()


def propose_to_proto(request: ProposeRequest) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        session_id=request.session_id, sync=common.sync_to_proto(request.sync), k=request.k,
        sampling=common.params_to_proto(request.params),
        min_confidence=request.min_confidence,
    )


def reply_to_proto(reply: DraftReply) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        tokens=reply.proposal.tokens,
        q=common.dists_to_proto(reply.proposal.q),
        position=reply.position,
        instance_id=reply.instance_id,
        compute_s=reply.compute_s,
        queued_s=reply.queued_s,
    )


def reply_from_proto(msg: draft_pb2.ProposeResponse) -> DraftReply:
    proposal = Proposal(tuple(msg.tokens), common.dists_from_proto(msg.q))
    return DraftReply(proposal, msg.position, msg.instance_id, msg.compute_s, msg.queued_s)
