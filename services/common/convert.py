"""Protobuf <-> core dataclasses for the messages both model services share."""

from __future__ import annotations

from specd import sparse
from specd.loop import SyncPoint
from specd.sampling import SamplingParams
from services.protogen.specd.v1 import common_pb2

MAX_SESSION_ID = 128
MAX_K = 32  # draft tokens per round a model service accepts


def session_id(value: str) -> str:
    if not value or len(value) > MAX_SESSION_ID:
        raise ValueError(f"session_id must be 1..{MAX_SESSION_ID} characters")
    return value


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    # proto3 cannot tell an unset top_p from 0, and 0 is no valid nucleus: read it as "off".
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed).validate()


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed
    )


def sync_from_proto(msg: common_pb2.SyncPoint) -> SyncPoint:
    return SyncPoint(msg.start_pos, tuple(msg.tokens), msg.instance_id)


def sync_to_proto(sync: SyncPoint) -> common_pb2.SyncPoint:
    return common_pb2.SyncPoint(start_pos=sync.start_pos, tokens=sync.tokens, instance_id=sync.instance_id)


def dists_from_proto(rows) -> tuple[sparse.SparseDist, ...]:
    return tuple(sparse.SparseDist(row.token_ids, row.probs) for row in rows)


def dists_to_proto(rows: tuple[sparse.SparseDist, ...]) -> list[common_pb2.SparseDist]:
    return [common_pb2.SparseDist(token_ids=row.token_ids, probs=row.probs) for row in rows]


def optional(msg, field: str) -> int | None:
    """A proto3 `optional` scalar: its value when set, else None."""
    return getattr(msg, field) if msg.HasField(field) else None
