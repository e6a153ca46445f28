"""The target service's edge: protobuf <-> dataclasses, with request validation."""

from __future__ import annotations

from dataclasses import dataclass

from specd.loop import SyncPoint, VerifyReply
from specd.sampling import SamplingParams
from specd.verify import Proposal
from specd.verify import Verdict
from services.common import convert as common
from services.protogen.specd.v1 import target_pb2


@dataclass(frozen=True)
class VerifyCall:
    session_id: str
    sync: SyncPoint
    proposal: Proposal
    params: SamplingParams


def verify_call(msg: target_pb2.VerifyRequest) -> VerifyCall:
    if len(msg.draft_tokens) > common.MAX_K:
        raise ValueError(f"at most {common.MAX_K} draft tokens per round")
    return VerifyCall(
        common.session_id(msg.session_id),
        common.sync_from_proto(msg.sync),
        Proposal(tuple(msg.draft_tokens), common.dists_from_proto(msg.q), common.optional(msg, "sibling")),
        common.params_from_proto(msg.sampling),
    )


def step_call(msg: target_pb2.StepRequest) -> VerifyCall:
    return VerifyCall(
        common.session_id(msg.session_id),
        common.sync_from_proto(msg.sync),
        Proposal((), ()),
        common.params_from_proto(msg.sampling),
    )


def verify_request(
    session_id: str, sync: SyncPoint, proposal: Proposal, params: SamplingParams
) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        session_id=session_id,
        sync=common.sync_to_proto(sync),
        draft_tokens=proposal.tokens,
        q=common.dists_to_proto(proposal.q),
        sampling=common.params_to_proto(params),
        sibling=proposal.sibling,
    )


def step_request(session_id: str, sync: SyncPoint, params: SamplingParams) -> target_pb2.StepRequest:
    return target_pb2.StepRequest(
        session_id=session_id, sync=common.sync_to_proto(sync), sampling=common.params_to_proto(params)
    )


def verify_response(reply: VerifyReply) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        num_accepted=reply.verdict.num_accepted,
        next_token=reply.verdict.next_token,
        position=reply.position,
        instance_id=reply.instance_id,
        compute_s=reply.compute_s,
        queued_s=reply.queued_s,
        batch_size=reply.batch_size,
        after_sibling=reply.verdict.after_sibling,
    )


def verify_reply(msg: target_pb2.VerifyResponse) -> VerifyReply:
    return VerifyReply(
        Verdict(msg.num_accepted, msg.next_token, common.optional(msg, "after_sibling")),
        msg.position, msg.instance_id, msg.compute_s, msg.queued_s, max(1, msg.batch_size),
    )
