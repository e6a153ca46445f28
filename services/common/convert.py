"""Protobuf <-> contract dataclasses (specd/contracts.py) for the messages both model services share."""

from __future__ import annotations

from specd.contracts import EngineInfo, ReplicaLoad, SamplingParams, SparseDist, SyncPoint, validate_session_id
from services.protogen.specd.v1 import common_pb2

ENGINE_INFO_REQUEST = common_pb2.EngineInfoRequest()  # it has no fields
LOAD_REQUEST = common_pb2.LoadRequest()


def session_id_from_proto(msg: common_pb2.SessionRef) -> str:
    return validate_session_id(msg.session_id)


def session_info_to_proto(position: int, kv_length: int, instance_id: str) -> common_pb2.SessionInfo:
    return common_pb2.SessionInfo(position=position, kv_length=kv_length, instance_id=instance_id)


def engine_info_to_proto(info: EngineInfo) -> common_pb2.EngineInfo:
    return common_pb2.EngineInfo(instance_id=info.instance_id, numerics=info.numerics, quantize=info.quantize,
                                 invariant=info.invariant, reason=info.reason, vocab_digest=info.vocab_digest,
                                 model=info.model, compute=info.compute, threads=info.threads)


def engine_info_from_proto(msg: common_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(msg.instance_id, msg.numerics, msg.quantize, msg.invariant, msg.reason, msg.vocab_digest,
                      msg.model, tuple(msg.compute), msg.threads)


def load_to_proto(load: ReplicaLoad) -> common_pb2.ReplicaLoad:
    return common_pb2.ReplicaLoad(instance_id=load.instance_id, sessions=load.sessions, max_sessions=load.max_sessions,
                                  queued=load.queued, max_batch=load.max_batch, draining=load.draining,
                                  cached_tokens=load.cached_tokens)


def load_from_proto(msg: common_pb2.ReplicaLoad) -> ReplicaLoad:
    return ReplicaLoad(msg.instance_id, msg.sessions, msg.max_sessions, msg.queued, msg.max_batch, msg.draining,
                       msg.cached_tokens)


def session_ref_to_proto(session_id: str) -> common_pb2.SessionRef:
    return common_pb2.SessionRef(session_id=session_id)


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    # proto3 cannot tell an unset top_p from 0, and 0 is no valid nucleus: read it as "off".
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed)


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed
    )


def sync_from_proto(msg: common_pb2.SyncPoint) -> SyncPoint:
    return SyncPoint(msg.start_pos, tuple(msg.tokens), msg.instance_id)


def sync_to_proto(sync: SyncPoint) -> common_pb2.SyncPoint:
    return common_pb2.SyncPoint(start_pos=sync.start_pos, tokens=sync.tokens, instance_id=sync.instance_id)


def dists_from_proto(rows) -> tuple[SparseDist, ...]:
    return tuple(SparseDist(row.token_ids, row.probs) for row in rows)


def dists_to_proto(rows: tuple[SparseDist, ...]) -> list[common_pb2.SparseDist]:
    return [common_pb2.SparseDist(token_ids=row.token_ids, probs=row.probs) for row in rows]
