"""Chaos soak: clients hold multi-turn greedy sessions against `specd up` with pools of two
draft and two target replicas (the tiny pair in float64, or with `--pair real` the fetched GGUF
pair; supervised children) and a Redis with
an append-only file, all real processes on loopback, while a schedule kills a draft, target,
coordinator or Redis process (each kind once in a random order, then again) with SIGKILL every 30-60 s (`specd up` restarts its
children; Redis is restarted from its AOF after a few seconds, as its own supervisor would).

A turn cut by a failure is reconciled from the session (`GetSession` with its tokens): the
committed tokens must be the client's history, then the turn's prompt (or nothing of this
turn), then the tokens it streamed and possibly more of the same continuation. Afterwards
every turn's output is checked against the target alone. Reported: turns, errors by status
(only retryable ones allowed), outputs that differ (must be 0), sessions whose committed tokens
disagree with what the client saw (lost or duplicated tokens: must be 0), and RSS over time.

    python -m benchmarks.chaos --minutes 5 --clients 16      # benchmarks/results/chaos.json
    python -m benchmarks.chaos --pair real --clients 4 --name chaos_real   # the fetched GGUF pair
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import TINY_UP_ENV, descendants, machine, rss_bytes, specd_up_logged, write
from services.common.redis_server import LocalRedis, free_port
from services.coordinator.model_info import load_model_info
from services.models import model_path
from specd.gguf_model import GGUFModel
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.tiny import build_tiny_pair

VICTIMS = ("draft", "target", "coordinator", "redis")
PAIRS = {"tiny": "tiny pair float64", "real": "the real pair (Qwen2.5-Coder 0.5B / 1.5B Q4_K_M GGUF)"}
RETRYABLE = {"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
TURNS_PER_SESSION = 4
TOKENS_PER_TURN = 24
REDIS_DOWN_S = 3.0
RSS_EVERY_S = 10.0
TEXTS = ["Tell me more.", " And then?", " def f(x):", " Once upon a time", " 1, 2, 3,", " Why?", " Go on:"]


@dataclass
class Turn:
    context: list[int]  # the session's committed tokens before the turn's output (its prompt included)
    output: list[int]


@dataclass
class Tally:
    turns: int = 0  # attempted
    completed: int = 0
    resumed: int = 0  # cut by a failure, the committed tokens adopted
    not_applied: int = 0  # cut before anything of the turn was committed: sent again
    inconsistent: list[str] = field(default_factory=list)  # committed tokens != what the client saw
    errors: collections.Counter = field(default_factory=collections.Counter)
    examples: dict[str, str] = field(default_factory=dict)
    checked: list[Turn] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(30.0, 60.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--victims", default=",".join(VICTIMS), help="which processes the schedule may kill")
    parser.add_argument("--name", default="chaos", help="results file: benchmarks/results/<name>.json")
    parser.add_argument("--pair", default="tiny", choices=("tiny", "real"),
                        help="the tiny pair in float64, or the fetched GGUF pair (`specd models fetch`) as served")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specd-chaos-") as tmp:
        result = soak(args, Path(tmp))
    print(f"wrote {write(args.name, result)}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss", "kills", "machine")}, indent=2))
    ok = not result["outputs_differing"] and not result["inconsistent_sessions"] and result["only_retryable_errors"]
    return 0 if ok else 1


def soak(args: argparse.Namespace, tmp: Path) -> dict:
    draft_dir, target_dir = build_tiny_pair(tmp / "pair") if args.pair == "tiny" else map(model_path, ("draft", "target"))
    model = load_model_info(target_dir)
    ports = _ports()
    rng = random.Random(args.seed)
    with LocalRedis(dir=tmp / "redis", appendonly=True) as redis:
        up = _specd_up(draft_dir, target_dir, redis.url, ports, tmp / "specd-up.log", args.pair)
        try:
            tally, kills, rss = Tally(), [], []
            stop = threading.Event()
            address = f"127.0.0.1:{ports['coordinator']}"
            clients = [threading.Thread(target=_client, args=(i, address, model, tally, stop, rng.random()))
                       for i in range(args.clients)]
            for client in clients:
                client.start()
            start = time.monotonic()
            end = start + 60 * args.minutes
            next_kill = start + rng.uniform(*args.kill_every)
            next_rss, schedule = start, []
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_kill:
                    if not schedule:  # every kind of victim once, in a random order, then again
                        schedule = rng.sample(args.victims.split(","), len(args.victims.split(",")))
                    victim = schedule.pop()
                    kills.append(_kill(victim, rng, ports, redis, up) | {"at_s": round(now - start, 1)})
                    next_kill = time.monotonic() + rng.uniform(*args.kill_every)
                if now >= next_rss:
                    rss.append({"at_s": round(now - start, 1), **_rss(up.pid, redis)})
                    next_rss += RSS_EVERY_S
                time.sleep(0.2)
            stop.set()
            for client in clients:
                client.join(timeout=180)
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=60)
    differing = (_check if args.pair == "tiny" else _check_gguf)(target_dir, tally.checked)
    only_retryable = all(code in RETRYABLE for code in tally.errors)
    return {
        "machine": machine(),
        "config": {"minutes": args.minutes, "clients": args.clients, "kill_every_s": list(args.kill_every),
                   "seed": args.seed, "victims": args.victims, "pools": f"specd up --draft-replicas 2 --target-replicas 2, {PAIRS[args.pair]}",
                   "turns_per_session": TURNS_PER_SESSION, "tokens_per_turn": TOKENS_PER_TURN},
        "turns": tally.turns,
        "completed": tally.completed,
        "resumed_after_a_failure": tally.resumed,
        "sent_again_nothing_committed": tally.not_applied,
        "tokens_checked": sum(len(t.output) for t in tally.checked),
        "errors": dict(tally.errors),
        "error_examples": tally.examples,
        "only_retryable_errors": only_retryable,
        "outputs_differing": differing,
        "inconsistent_sessions": tally.inconsistent,
        "kills": kills,
        "rss": rss,
    }


def _ports() -> dict[str, int]:
    """Free ports for the coordinator, and for draft/target replicas 0 and 1 (`specd up` adds 100)."""
    while True:
        ports = {role: free_port() for role in ("coordinator", "draft", "target")}
        if len(set(ports.values())) == 3 and all(_free(ports[r] + 100) for r in ("draft", "target")):
            return ports


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _specd_up(draft_dir: Path, target_dir: Path, redis_url: str, ports: dict[str, int], log: Path,
              pair: str) -> subprocess.Popen:
    argv = ["--draft-replicas", "2", "--target-replicas", "2",
            "--draft-model", str(draft_dir), "--target-model", str(target_dir), "--redis-url", redis_url,
            "--coordinator-port", str(ports["coordinator"]), "--draft-port", str(ports["draft"]),
            "--target-port", str(ports["target"]), "--http-port", "-1",
            "--draft-metrics-port", "0", "--target-metrics-port", "0", "--audit-rate", "0"]
    if pair == "tiny":
        return specd_up_logged([*argv, "--draft-quantize", "none", "--target-quantize", "none"], log, TINY_UP_ENV)
    return specd_up_logged(argv, log, {}, timeout_s=900)  # the GGUF files as `specd up` serves them


def _client(index: int, address: str, model, tally: Tally, stop: threading.Event, seed: float) -> None:
    rng = random.Random(seed)
    channel = grpc.insecure_channel(address)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    sessions = 0
    while not stop.is_set():
        session, history = f"chaos-{index}-{sessions}", []
        sessions += 1
        for _ in range(TURNS_PER_SESSION):
            ids = model.encode(rng.choice(TEXTS))
            while not stop.is_set():  # a turn not applied at all is sent again
                outcome = _turn(stub, session, history, ids, tally, plain=index % 2 == 1)
                if outcome != "again":
                    break
            if outcome in ("again", "broken") or stop.is_set():
                break
        try:
            _call(lambda: stub.ReleaseSession(coordinator_pb2.SessionRequest(session_id=session), timeout=30))
        except grpc.RpcError:  # it expires (TTL)
            pass
    channel.close()


def _turn(stub, session: str, history: list[int], ids: list[int], tally: Tally, plain: bool) -> str:
    """One turn: "done", "again" (nothing committed: send it again) or "broken" (inconsistent).
    `plain`: speculation off, so the turn's steps come from one stream of the target's (`Decode`)."""
    request = coordinator_pb2.GenerateRequest(token_ids=coordinator_pb2.TokenIds(ids=ids), max_tokens=TOKENS_PER_TURN,
                                              session_id=session, ignore_eos=True, **({"speculation": False} if plain else {}))
    streamed: list[int] = []
    with tally.lock:
        tally.turns += 1
    try:
        for chunk in stub.Generate(request, timeout=120):
            streamed += chunk.token_ids
    except grpc.RpcError as error:
        with tally.lock:
            tally.errors[error.code().name] += 1
            tally.examples.setdefault(error.code().name, error.details() or "")
        return _reconcile(stub, session, history, ids, streamed, tally)
    with tally.lock:
        tally.completed += 1
        tally.checked.append(Turn(history + ids, streamed))
    history += ids + streamed
    return "done"


def _reconcile(stub, session: str, history: list[int], ids: list[int], streamed: list[int], tally: Tally) -> str:
    """After a failed turn: what did the session commit?"""
    try:
        summary = _call(lambda: stub.GetSession(
            coordinator_pb2.SessionRequest(session_id=session, include_tokens=True), timeout=30))
    except grpc.RpcError as error:
        with tally.lock:
            tally.inconsistent.append(f"{session}: could not be read back ({error.code().name})")
        return "broken"
    committed = list(summary.token_ids) if summary is not None else []
    if committed == history and not streamed:
        with tally.lock:
            tally.not_applied += 1
        return "again"
    context = history + ids
    output = committed[len(context):]
    if committed[: len(context)] != context or output[: len(streamed)] != streamed:
        with tally.lock:
            tally.inconsistent.append(f"{session}: committed {len(committed)} tokens, client saw "
                                      f"{len(history)} + {len(ids)} + {len(streamed)}")
        return "broken"
    with tally.lock:
        tally.resumed += 1
        if output:
            tally.checked.append(Turn(context, output))
    history += ids + output
    return "done"


def _call(rpc, wait_s: float = 120.0):
    """The reply of `rpc`, retried while the coordinator or Redis is down; None for NOT_FOUND."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return rpc()
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _kill(role: str, rng: random.Random, ports: dict[str, int], redis: LocalRedis, up: subprocess.Popen) -> dict:
    if role == "redis":
        redis.kill9()
        time.sleep(REDIS_DOWN_S)
        redis.start()
        return {"victim": "redis"}
    replica = rng.randrange(2) if role != "coordinator" else 0
    port = ports[role] + 100 * replica
    pid = _child_pid(up.pid, role, port)
    if pid is None:  # restarting right now
        return {"victim": f"{role}-{replica}", "skipped": "not running"}
    os.kill(pid, signal.SIGKILL)
    return {"victim": f"{role}-{replica}", "pid": pid}


def _child_pid(parent: int, role: str, port: int) -> int | None:
    for pid, command in descendants(parent).items():
        if f"services.{role} " in command and f" --port {port} " in f"{command} ":
            return pid
    return None


def _rss(up_pid: int, redis: LocalRedis) -> dict:
    by_role: dict[str, float] = collections.defaultdict(float)
    for pid, command in descendants(up_pid).items():
        role = next((word.removeprefix("services.") for word in command.split() if word.startswith("services.")),
                    "other")
        by_role[role] += rss_bytes(pid) / 2**20
    by_role["redis"] = rss_bytes(redis.pid) / 2**20 if redis.pid else 0.0
    by_role["specd_up"] = rss_bytes(up_pid) / 2**20
    return {f"{role}_mb": round(mb, 1) for role, mb in sorted(by_role.items())} | {
        "total_mb": round(sum(by_role.values()), 1)}


def _check(target_dir: Path, turns: list[Turn]) -> int:
    """Turns whose output is not the target's alone: a teacher-forced pass over context + output
    (its argmax at each output position), then, for any turn that pass disputes, HF `generate`."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    model.generation_config.eos_token_id = None
    differing = 0
    with torch.no_grad():
        for turn in turns:
            ids = torch.tensor([turn.context + turn.output])
            argmax = model(ids).logits[0, len(turn.context) - 1 : -1].argmax(-1).tolist()
            if argmax == turn.output:
                continue
            context = torch.tensor([turn.context])
            generated = model.generate(context, attention_mask=torch.ones_like(context), do_sample=False,
                                       max_new_tokens=len(turn.output), pad_token_id=0)
            differing += generated[0, len(turn.context):].tolist() != turn.output
    return differing


def _check_gguf(target_file: Path, turns: list[Turn]) -> int:
    """Turns whose output is not the GGUF target's alone: one pass over context + output, each output
    position's argmax (the decoder's rows are its one-row steps bit for bit, specd/csrc/decoder.c)."""
    model, differing = GGUFModel(target_file), 0
    for turn in turns:
        rows = model.forward([model.new_cache()], [turn.context + turn.output], [len(turn.output) + 1])[0]
        differing += rows[:-1].argmax(-1).tolist() != turn.output
    return differing


if __name__ == "__main__":
    sys.exit(main())
