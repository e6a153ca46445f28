"""The target service's edge: protobuf <-> contract dataclasses (specd/contracts.py), with
request validation. Verify and Step (K = 0) both become a `VerifyRequest`."""

from __future__ import annotations

from specd.contracts import DecodeRequest, Proposal, Verdict, VerifyReply, VerifyRequest
from specd.validation import InvalidParams
from services.common import convert as common
from services.protogen.specd.v1 import target_pb2


def verify_from_proto(msg: target_pb2.VerifyRequest) -> VerifyRequest:
    proposal = Proposal(tuple(msg.draft_tokens), common.dists_from_proto(msg.q))
    return VerifyRequest(
        msg.session_id, common.sync_from_proto(msg.sync), proposal, common.params_from_proto(msg.sampling)
    ).validate()


def step_from_proto(msg: target_pb2.StepRequest) -> VerifyRequest:
    return VerifyRequest(
        msg.session_id, common.sync_from_proto(msg.sync), Proposal((), ()), common.params_from_proto(msg.sampling)
    ).validate()


def decode_from_proto(msg: target_pb2.DecodeMessage) -> DecodeRequest:
    """A stream's first message: its start (any other is refused)."""
    if msg.WhichOneof("kind") != "start":
        raise InvalidParams("a Decode stream starts with its start message")
    return DecodeRequest(step_from_proto(msg.start.step), msg.start.max_steps).validate()


def decode_to_proto(request: DecodeRequest) -> target_pb2.DecodeMessage:
    return target_pb2.DecodeMessage(start=target_pb2.DecodeStart(step=step_to_proto(request.step),
                                                                 max_steps=request.max_steps))


def taken_to_proto(taken: int) -> target_pb2.DecodeMessage:
    return target_pb2.DecodeMessage(taken=taken)


def verify_to_proto(request: VerifyRequest) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        session_id=request.session_id,
        sync=common.sync_to_proto(request.sync),
        draft_tokens=request.proposal.tokens,
        q=common.dists_to_proto(request.proposal.q),
        sampling=common.params_to_proto(request.params),
    )


def step_to_proto(request: VerifyRequest) -> target_pb2.StepRequest:
    """A request with K = 0: its proposal is empty."""
    return target_pb2.StepRequest(
        session_id=request.session_id,
        sync=common.sync_to_proto(request.sync),
        sampling=common.params_to_proto(request.params),
    )


def reply_to_proto(reply: VerifyReply) -> target_pb2.VerifyResponse:
    return target_pb2.VerifyResponse(
        num_accepted=reply.verdict.num_accepted,
        next_token=reply.verdict.next_token,
        position=reply.position,
        instance_id=reply.instance_id,
        compute_s=reply.compute_s,
        queued_s=reply.queued_s,
        batch_size=reply.batch_size,
        pass_rows=reply.pass_rows,
        confidence=reply.confidence,
        active_sessions=reply.active_sessions,
    )


def reply_from_proto(msg: target_pb2.VerifyResponse) -> VerifyReply:
    return VerifyReply(
        Verdict(msg.num_accepted, msg.next_token),
        msg.position, msg.instance_id, msg.compute_s, msg.queued_s, max(1, msg.batch_size), msg.pass_rows,
        tuple(msg.confidence), active_sessions=max(1, msg.active_sessions),
    )
