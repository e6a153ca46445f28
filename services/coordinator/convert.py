"""The coordinator's gRPC edge: a GenerateRequest into a ClientRequest (validated in
requests.py), and loop events into responses."""

from __future__ import annotations

from specd.loop import Chunk, Finished
from specd.session import SessionState, SessionStats
from services.coordinator.requests import ClientRequest
from services.protogen.specd.v1 import coordinator_pb2


def client_request(msg: coordinator_pb2.GenerateRequest) -> ClientRequest:
    kind = msg.WhichOneof("prompt")

    def optional(field: str):
        return getattr(msg, field) if msg.HasField(field) else None

    return ClientRequest(
        text=msg.text if kind == "text" else None,
        token_ids=tuple(msg.token_ids.ids) if kind == "token_ids" else None,
        max_tokens=optional("max_tokens"),
        stop=tuple(msg.stop),
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=optional("top_p"),
        seed=optional("seed"),
        num_draft_tokens=optional("num_draft_tokens"),
        ignore_eos=msg.ignore_eos,
        session_id=msg.session_id,
        speculation=optional("speculation"),
        max_draft_tokens=optional("max_draft_tokens"),
        request_id=msg.request_id,
        drafter=msg.drafter,
    )


def stats_to_proto(
    stats: SessionStats, prompt_tokens: int, completion_tokens: int, mode: str
) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        rounds=stats.rounds,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
        drafted_per_position=stats.drafted_per_position,
        fallbacks=stats.fallbacks,
        resyncs=stats.resyncs,
        judged_tokens=stats.judged,
        draft_compute_s=stats.draft_compute_s,
        verify_compute_s=stats.verify_compute_s,
        round_wall_s=stats.round_wall_s,
        outage_rounds=stats.outage_rounds,
        model_free_drafted_tokens=stats.model_free_drafted,
        model_free_accepted_tokens=stats.model_free_accepted,
        draft_wall_s=stats.draft_wall_s,
        verify_wall_s=stats.verify_wall_s,
        verify_queued_s=stats.verify_queued_s,
        save_s=stats.save_s,
        mode=mode,
    )


def final_stats(done: Finished, prompt_tokens: int) -> coordinator_pb2.GenerationStats:
    return stats_to_proto(done.stats, prompt_tokens, len(done.token_ids), done.session.policy.mode)


def stream_response(event: Chunk | Finished, prompt_tokens: int) -> coordinator_pb2.GenerateResponse:
    """A streamed chunk, or the stream's last message (finish reason and stats)."""
    if isinstance(event, Chunk):
        return coordinator_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
    return coordinator_pb2.GenerateResponse(finish_reason=event.finish_reason, stats=final_stats(event, prompt_tokens))


def released() -> coordinator_pb2.ReleaseSessionResponse:
    return coordinator_pb2.ReleaseSessionResponse(released=True)


def complete_response(done: Finished, prompt_tokens: int) -> coordinator_pb2.CompleteResponse:
    return coordinator_pb2.CompleteResponse(
        text=done.text,
        token_ids=done.token_ids,
        finish_reason=done.finish_reason,
        stats=final_stats(done, prompt_tokens),
    )


def session_summary(state: SessionState, include_tokens: bool = False) -> coordinator_pb2.SessionSummary:
    return coordinator_pb2.SessionSummary(
        token_ids=state.tokens if include_tokens else (),
        session_id=state.session_id,
        length=len(state.tokens),
        mode=state.policy.mode,
        k=state.policy.k,
        alpha=state.policy.estimates.alpha,
        stats=stats_to_proto(state.stats, 0, 0, state.policy.mode),
        requests=state.requests,
    )
