"""The figures of benchmarks/README.md, generated from benchmarks/results/*.json.

    python -m benchmarks.report            rewrite the generated blocks
    python -m benchmarks.report --check    exit 1 when a block is not what the results say

A block sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; NAME is a key of
BLOCKS. Text outside the blocks (how each benchmark runs, the reading of its figures) is kept."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- generated: (\S+) -->\n)(.*?)(<!-- end generated -->)", re.DOTALL)
CLASSES = ("code", "prose", "chat")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def para(text: str) -> str:
    return textwrap.fill(text, 100, break_on_hyphens=False) + "\n"


def load(results: Path, name: str) -> dict:
    return json.loads((results / f"{name}.json").read_text())


# -- specd against llama-server (specd bench --llama-server) ------------------------------------

LABELS = {"plain": ("specd plain (speculation off)", True), "adaptive": ("specd adaptive", True),
          "adaptive_model": ("specd adaptive, draft model only", False),
          "llama_plain": ("llama-server plain", True), "llama_spec": ("llama-server speculative", False),
          "llama_ngram": ("llama-server n-gram", False)}


def _configs(run: dict) -> list[tuple[str, str, bool]]:
    """(key, label, with TTFT) of each configuration the run has, in the table's order."""
    ran = next(iter(run["classes"].values()))["configs"]
    fixed = [f"K={k}" for k in run["settings"]["ks"]]
    order = ["plain", *fixed, "adaptive", "adaptive_model", "llama_plain", "llama_spec", "llama_ngram"]
    return [(key, *LABELS.get(key, (f"specd K = {key[2:]}", False))) for key in order if key in ran]


def _cell(config: dict, ttft: bool) -> str:
    return f"{config['tokens_per_s']:.1f}" + (f" ({config['ttft_s']:.2f})" if ttft else "")


def _lossless(run: dict) -> str:
    lossless = run["lossless"]
    checked, wrong = lossless["checked"], len(lossless["mismatches"])
    specd = (f"specd's {checked} outputs all equal its own plain decoding" if not wrong
             else f"{wrong} of specd's {checked} outputs differ from its own plain decoding")
    peers = []
    for key, what in (("llama_spec_equals_its_plain", "speculative"), ("llama_ngram_equals_its_plain", "n-gram")):
        same = lossless.get(key, {})
        differ = [prompt for prompt, equal in same.items() if not equal]
        if same:
            peers.append(f"llama-server's {what} text differed from its own plain text on {len(differ)} of "
                         f"{len(same)} prompts ({', '.join(differ) or 'none'})")
    return para("; ".join([specd, *peers]) + ".")


def _rss(run: dict) -> str:
    rss = run["rss_gb"]
    total = rss["draft"] + rss["target"] + rss["coordinator"]
    peers = [f"{rss[key]:.2f} {what}" for key, what in (("llama_plain", "plain"), ("llama_spec", "speculative"),
                                                          ("llama_ngram", "n-gram")) if key in rss]
    return para(f"Memory (RSS): specd {total:.2f} GB (draft {rss['draft']:.2f}, target {rss['target']:.2f}, "
                f"coordinator {rss['coordinator']:.2f})" + ("; llama-server " + ", ".join(peers) if peers else "") + ".")


def _concurrency(run: dict) -> str:
    c = run.get("concurrency")
    if not c:
        return ""
    return para(f"{c['sessions']} concurrent sessions × {run['settings']['tokens']} tokens: specd "
                f"{c['concurrent_tokens_per_s']:.1f} tok/s aggregate ({c['ratio']:.2f}× its sequential "
                f"{c['sequential_tokens_per_s']:.1f}) against `llama-server -np {c['sessions']}` "
                f"{c['llama_concurrent_tokens_per_s']:.1f} tok/s.")


def llama(name: str) -> Callable[[Path], str]:
    def render(results: Path) -> str:
        run = load(results, name)
        prompts = list(run["settings"]["prompts"].values())
        classes = run["classes"]
        counts = ", ".join(f"{prompts.count(c)} {c}" for c in classes)
        rows = [[label, *(_cell(classes[c]["configs"][key], ttft) for c in classes)]
                for key, label, ttft in _configs(run)]
        alphas = [f"{classes[c]['configs']['adaptive']['alpha']:.2f}" for c in classes]
        rows.append(["acceptance α (adaptive)", *alphas])
        if any(classes[c]["configs"]["adaptive"].get("model_free_share") is not None for c in classes):
            rows.append(["drafted from the tokens at hand (adaptive)",
                         *(f"{classes[c]['configs']['adaptive'].get('model_free_share', 0) * 100:.0f} %" for c in classes)])
        services = run["settings"]["services"]
        deployment = " (the target alone: `--draft-replicas 0`)" if "--draft-replicas 0" in services else ""
        head = para(f"`results/{name}.json`{deployment}: prompts {counts}; {run['settings']['tokens']} new tokens; "
                    f"every configuration {run['settings']['repeats']}×; {run['machine']['cpu']}; "
                    f"{run['duration_s'] / 60:.1f} min.") + "\n"
        parts = [table(["tok/s (TTFT s)", *classes], rows), _concurrency(run), _lossless(run), _rss(run)]
        return head + "\n".join(part for part in parts if part)
    return render


# -- goals ---------------------------------------------------------------------------------------

def _value(goal: str, measured: float) -> str:
    if "GB" in goal:
        return f"{measured:.2f} GB"
    if "%" in goal:
        return f"{measured * 100:.0f} %"
    if "theoretical" in goal:
        return f"{measured:.2f}"
    return f"{measured:.2f}×"


def _grouped(goals: list[dict]) -> dict[str, dict[str, tuple[str, str, bool]]]:
    """Goal rows by name: per class (or "" for a goal of the whole run), its bound, value and verdict."""
    rows: dict[str, dict[str, tuple[str, str, bool]]] = {}
    for goal in goals:
        text = goal["goal"]
        scope, _, rest = text.partition(": ") if text.split(":")[0] in CLASSES else ("", "", text)
        what, _, bound = rest.partition(" ≥ ")
        rows.setdefault(what, {})[scope] = (bound, _value(text, goal["measured"]), goal["met"])
    return rows


def _label(what: str, by_scope: dict[str, tuple[str, str, bool]]) -> str:
    if "" in by_scope:
        bound = by_scope[""][0]
        return what + (f" ≥ {bound}" if bound else "")
    bounds = [f"{scope} ≥ {by_scope[scope][0]}" for scope in CLASSES if by_scope[scope][0]]
    return what + (": " + ", ".join(bounds) if bounds else ", every class")


def _verdict(verdicts: list[bool | None]) -> str:
    ran = [v for v in verdicts if v is not None]
    if all(ran):
        return "yes"
    if not any(ran):
        return "no"
    return "reference only" if verdicts[0] else "held-out only"


def goals(results: Path, reference: str = "bench_llama", held_out: str = "bench_llama_heldout") -> str:
    runs = [load(results, reference), load(results, held_out)]
    grouped = [_grouped(run["goals"]) for run in runs]
    rows = []
    for what, by_scope in grouped[0].items():
        cells, verdicts = [], []
        for g in grouped:
            scopes = g.get(what)
            order = [""] if scopes and "" in scopes else list(CLASSES)
            cells.append(" / ".join(scopes[s][1] for s in order) if scopes else "(not run)")
            verdicts.append(all(scopes[s][2] for s in order) if scopes else None)
        rows.append([_label(what, by_scope), *cells, _verdict(verdicts)])
    lossless = [run["lossless"] for run in runs]
    rows.append(["lossless: every specd output equals its own plain decoding",
                 *(f"{x['checked'] - len(x['mismatches'])} of {x['checked']}" for x in lossless),
                 _verdict([not x["mismatches"] for x in lossless])])
    return table(["goal", "reference prompts", "held-out prompts", "met"], rows)


# -- quality (specd bench --quality) --------------------------------------------------------------

ENGINES = {"float32": "float32 (transformers, dequantised)", "specd": "specd (GGUF engine)", "llama.cpp": "llama.cpp"}


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def _goal_verdict(met: bool | None) -> str:
    return {True: "met", False: "not met", None: "not measured"}[met]


def _differs(e: dict) -> str:
    d = e.get("differs")
    if not d:
        return "–"
    gap = d["float32_top2_gap"]
    return str(d["positions"]) + (f" ({gap['median']:.2f} / {gap['max']:.2f})" if gap else "")


def _measured(measured: list | dict) -> str:
    """A goal's figures, per text: ratios as they are, agreements (a dict by engine) as shares."""
    if isinstance(measured, dict):
        parts = [f"{engine} " + ", ".join(_share(v) for v in values) for engine, values in measured.items()]
    else:
        parts = [", ".join("–" if v is None else f"{v:.4f}" for v in measured)]
    return " (" + "; ".join(parts) + ")"


def quality(name: str) -> Callable[[Path], str]:
    """Per text and engine: perplexity, its ratio to float32's, argmax agreement with float32 (every
    scored position; the sampled ones), where it differs; then tokenisation, cross-checks and goals."""
    def render(results: Path) -> str:
        run = load(results, name)
        model, settings = run["model"], run["settings"]
        first, stop = settings["scored_rows"]
        head = para(f"`results/{name}.json`: `{model['file']}` ({model['architecture']}; "
                    f"{', '.join(model['tensor_types'])}; sha256 {model['sha256']}…), chunks of {settings['ctx']} "
                    f"tokens, rows {first}–{stop - 1} of each scored; {settings['sample']} sampled positions per "
                    f"text; {run['machine']['cpu']}, {run['machine']['threads']} threads, {run['date'][:10]}; "
                    f"{run['duration_s'] / 60:.1f} min.") + "\n"
        rows = []
        for text_name, text in run["texts"].items():
            label = f"{text_name} ({text['tokens']} tokens, {text['positions']} scored)"
            for i, (engine, e) in enumerate(text["engines"].items()):
                ratio = "–" if e["ratio"] is None else f"{e['ratio']:.4f}"
                rows.append([label if i == 0 else "", ENGINES.get(engine, engine), f"{e['perplexity']:.4f}", ratio,
                             _share(e["agreement"]), _share(e["agreement_sample"]), _differs(e)])
        body = table(["text", "engine", "perplexity", "× float32", "argmax = float32's", "at the sampled",
                      "differs at (float32 top-2 gap: median / max)"], rows)
        llama = {t: text["engines"]["llama.cpp"] for t, text in run["texts"].items() if "llama.cpp" in text["engines"]}
        notes = []
        if llama:
            differ = {t: e for t, e in llama.items() if not (e["tokens_match"] and e["saved_tokens_match"])}
            notes.append(
                "llama.cpp tokenised " + ("every text to the same ids as specd" if not differ else
                                          "; ".join(f"{t} differently from specd (first at token "
                                                    f"{e.get('first_token_difference')}; {e['tokens']} tokens against "
                                                    f"{run['texts'][t]['tokens']})" for t, e in differ.items())
                                          + ": its perplexity there is of its own tokens (no ratio), its argmax "
                                            "llama-server's at every scored position of specd's tokens")
                + " (the tokens llama-perplexity saved; llama-server's /tokenize). Its argmax over every position is "
                + ("otherwise " if differ else "") + "llama-perplexity's own pass (the log-probabilities it saves "
                "with --kl-divergence-base), at the sampled positions llama-server's (/completion, one token).")
            checked = {t: e for t, e in llama.items() if e.get("server_same_as_perplexity_sample") is not None}
            if checked:
                notes.append("llama-server chose as llama-perplexity's pass at "
                             + ", ".join(f"{_share(e['server_same_as_perplexity_sample'])} ({t})"
                                         for t, e in checked.items()) + " of the sampled positions.")
            compared = {t: e for t, e in llama.items() if e.get("only_specd_differs") is not None}
            if compared:
                notes.append(
                    "specd and llama.cpp chose the same token at "
                    + ", ".join(f"{_share(e['same_argmax_as_specd'])} ({t})" for t, e in compared.items())
                    + " of the scored positions. Where only one of the two differs from float32, it is "
                    + "; ".join(f"specd alone at {e['only_specd_differs']} positions and llama.cpp alone at "
                                f"{e['only_llama_differs']} ({t})" for t, e in compared.items()) + ".")
        notes += [f"Goal: {g['goal']}: {_goal_verdict(g['met'])}{_measured(g['measured'])}." for g in run["goals"]]
        return head + body + "\n" + "\n".join(para(n) for n in notes)
    return render


# -- the other benchmarks -------------------------------------------------------------------------

def _rows_label(run: dict, first: dict) -> str:
    """The run's role, and how its build or host differs from the first run's."""
    build = f" ({run['march']} build)" if run.get("march", "native") != "native" else ""
    weights = f" (as {run['quantize'].upper()})" if run.get("quantize", "auto") != "auto" else ""
    host = run["machine"]["vector_extensions"]
    other = f" ({run['machine']['cpu']}, {'/'.join(host)} only)" if host != first["machine"]["vector_extensions"] else ""
    return f"{run['role']} ms{weights}{build}{other}"


def rows(results: Path) -> str:
    runs = [load(results, name) for name in ("rows", "rows_draft", "rows_haswell", "rows_avx2", "rows_draft_avx2")]
    counts = list(runs[0]["pass_s"])

    def ms(run: dict, key: str) -> str:
        return f"{run[key] * 1e3:.1f}" if key in run else "—"

    body = [[_rows_label(run, runs[0]), *(f"{run['pass_s'][n] * 1e3:.1f}" if n in run["pass_s"] else "—" for n in counts),
             ms(run, "decode_per_token_s"), ms(run, "llama_server_per_token_s")] for run in runs]
    head = para(f"One pass of a session holding {runs[0]['context']} tokens, by rows fed ({runs[0]['machine']['cpu']}, "
                f"{runs[0]['threads']} threads, median of {runs[0]['repeats']} for the first row, of each file's "
                "`repeats` for the others); plain decoding's time per token, the "
                "engine's alone (one-row passes in a row) and llama-server's own on the same file (its "
                "`predicted_per_token_ms`), taken side by side after each repeat (a row without the engine's: "
                "llama-server's was timed after the sweep, minutes apart):") + "\n"
    return head + table(["rows", *counts, "decoding", "llama-server"], body)


def rows_against(name: str) -> Callable[[Path], str]:
    """A `benchmarks.rows --against REV` run: this checkout's kernels and REV's, pass by pass."""
    def render(results: Path) -> str:
        run = load(results, name)
        counts = list(run["pass_s"])
        extra = run["extra_row_s"]
        head = para(f"`results/{name}.json`: {run['model']}, {run['machine']['cpu']} "
                    f"({'/'.join(run['machine']['vector_extensions'])}), {run['threads']} threads, medians of "
                    f"{run['repeats']}, the two builds' passes in turn:") + "\n"
        body = [[label, *(f"{run[key][n] * 1e3:.1f}" for n in counts), f"{extra[which] * 1e3:.2f}"]
                for label, key, which in (("this checkout", "pass_s", "this"),
                                          (f"against {run['against']['commit'][:7]}", "against_pass_s", "against"))]
        return head + table(["pass ms by rows", *counts, "extra row ms (to 5 rows)"], body)
    return render


def head_vocab(results: Path) -> str:
    run = load(results, "head_vocab")
    sizes = list(run["step_s"])
    full = run["step_s"]["0"]
    body = [["draft step ms", *(f"{run['step_s'][n] * 1e3:.2f}" for n in sizes)],
            ["÷ every id", *(f"{run['step_s'][n] / full:.2f}" for n in sizes)]]
    body += [[f"agreement, `{name}`", *(f"{by_size[n]:.3f}" for n in sizes)] for name, by_size in run["agreement"].items()]
    head = para(f"`results/head_vocab.json`: {run['draft']} ({run['vocab']} ids) drafting for {run['target']}, "
                f"{run['machine']['cpu']}; agreement: the draft's greedy token is the target's, over the target's "
                f"own {run['tokens']} greedy tokens of each prompt.") + "\n"
    return head + table(["ids scored", *("every id" if n == "0" else n for n in sizes)], body)


def chaos(results: Path, name: str = "chaos") -> str:
    run = load(results, name)
    config, kills = run["config"], run["kills"]
    totals = [sample["total_mb"] / 1e3 for sample in run["rss"]]
    errors = "; ".join(f'{n} × {code} ("{run["error_examples"][code]}")' for code, n in run["errors"].items())
    body = [
        ["setup", f"{config['pools']}; {config['clients']} clients, {config['turns_per_session']} turns of "
                  f"{config['tokens_per_turn']} tokens; {config['minutes']:.0f} min"],
        ["kills", ", ".join(f"{k['victim']} at {k['at_s']:.0f} s" for k in kills)],
        ["turns", f"{run['turns']} ({run['completed']} completed, {run['resumed_after_a_failure']} cut and resumed "
                  f"from the session, {run['sent_again_nothing_committed']} sent again)"],
        ["tokens checked against the target alone", f"{run['tokens_checked']:,}".replace(",", " ")
         + f": {run['outputs_differing']} differ"],
        ["sessions whose committed tokens disagree with what the client saw", str(len(run["inconsistent_sessions"]))],
        ["errors", (errors or "none") + ("; all retryable" if run["only_retryable_errors"] else "")],
        ["RSS, all processes", f"{min(totals):.2f}–{max(totals):.2f} GB ({totals[0]:.2f} at the start, "
                               f"{totals[-1]:.2f} at the end)"],
    ]
    return table(["what", "result"], body)


def abuse(results: Path) -> str:
    """The well-behaved clients alone and beside each abusers' run (`python -m benchmarks.abuse`)."""
    names = ("abuse", "abuse_repeat", "abuse_big_chat")
    runs = [load(results, name) for name in names]
    head = ["abusers", "TTFT p99 alone / beside (ms)", "tok/s alone / beside", "ratios (TTFT, tok/s; goal ≤ 1.25)",
            "5xx", "abusive requests: statuses (longest s)"]
    body = []
    for name, run in zip(names, runs):
        alone, beside = run["alone"], run["beside_abusers"]
        answered = "; ".join(f"{kind} {', '.join(f'{n}×{code}' for code, n in codes.items())} "
                             f"({beside['longest_s'][kind]:g})" for kind, codes in beside["statuses"].items()
                             if kind != "good")
        body.append([", ".join(run["config"]["abusers"]) + (" (again)" if name == "abuse_repeat" else ""),
                     f"{alone['ttft_p99_s'] * 1e3:.0f} / {beside['ttft_p99_s'] * 1e3:.0f}",
                     f"{alone['tokens_per_s']:.0f} / {beside['tokens_per_s']:.0f}",
                     f"{run['ttft_p99_ratio']:.2f}, {run['tokens_per_s_ratio']:.2f}", str(run["server_errors"]), answered])
    config = runs[0]["config"]
    return para(f"{config['deployment']}; {config['good_clients']} streaming clients of {config['good_max_tokens']} "
                f"tokens; {config['rounds']} pairs of {config['seconds_per_phase']:.0f}-s phases, alone and beside the "
                f"abusers in turn; each key {config['key_max_in_flight']} in flight and "
                f"{config['key_requests_per_minute']} requests a minute, stream stall {config['stream_stall_s']:g} s, "
                f"long requests background from {config['background_after_tokens']} tokens; the abusers' process at "
                f"nice 19 ({runs[0]['machine']['cpu']}):") + "\n" + table(head, body)


def _fallback_rows(kind: str, prompts: list[dict], overall: float) -> list[list[str]]:
    body = []
    for prompt in prompts:
        adaptive = [r for r in prompt["runs"] if r["label"] == "adaptive"]
        rounds = ", ".join(str(r["drafting_rounds"]) for r in adaptive)
        body.append([f"{kind}, {prompt['prompt']}", f"{prompt['ratio_vs_plain']:.2f}", rounds,
                     str(sum(r["fallbacks"] for r in adaptive))])
    return body + [[f"{kind}, all together", f"{overall:.2f}", "", ""]]


def fallback(results: Path) -> str:
    run = load(results, "fallback")
    body = (_fallback_rows("useless draft", run["useless_draft"], run["useless_draft_overall_ratio"])
            + _fallback_rows("real pair", run["real_pair_code"], run["real_pair_code_overall_ratio"]))
    head = f"{run['tokens']} tokens per request; each prompt {run['repeats']}× plain, {run['repeats']}× adaptive:\n\n"
    return head + table(["configuration", "ratio vs plain", "drafting rounds (adaptive runs)", "fallbacks"], body)


ABLATIONS = (("ab21_base", "every mechanism as specd up runs it"), ("ab21_core_turns_off", "core turns off"),
             ("ab21_conf_0", "confidence stop off (--draft-confidence 0)"),
             ("ab21_pipeline_auto", "pipelined drafting auto (since removed)"))


def ablation(results: Path) -> str:
    """Adaptive K with one mechanism changed: tok/s per class (× that run's own plain decoding)."""
    rows = []
    for name, label in ABLATIONS:
        run = load(results, name)
        cells = [_rate_against(run["classes"][kind]["configs"], "adaptive", "plain") for kind in CLASSES]
        rows.append([label, *cells, f"{run['concurrency']['concurrent_tokens_per_s']:.1f}"])
    return table(["adaptive K, tok/s (× plain)", *CLASSES, "8 concurrent, tok/s"], rows)


def before_after(results: Path) -> str:
    """The reference command on the code before this issue's refactors and removals and after,
    one run each, back to back: tok/s per class (× llama-server plain in the same run)."""
    rows = []
    for name, label in (("ab21_before", "before"), ("ab21_after", "after")):
        run = load(results, name)
        for config, what in (("plain", "specd plain"), ("adaptive", "specd adaptive")):
            cells = [_rate_against(run["classes"][kind]["configs"], config, "llama_plain") for kind in CLASSES]
            rows.append([f"{what}, {label}", *cells])
    return table(["tok/s (× llama-server plain)", *CLASSES], rows)


def round_parts(results: Path, name: str = "round_parts") -> str:
    """Milliseconds of a steady-state round by part, plain and adaptive (specd bench --round-parts)."""
    run = load(results, name)
    parts = run["parts_ms_per_round"]
    names = {"target_pass": "target pass", "draft": "draft calls", "queued": "queued at the target",
             "verify_rpc": "verify RPC (gRPC, TLS, both sides' Python)",
             "coordinator": "coordinator (loop, policy, stop rules, the save's unhidden part, streaming)",
             "delivery": "delivery (the gRPC server around the rounds)", "save_overlapped": "save (beside the next round)",
             "fixed_ms": "fixed cost (all but the model passes)"}
    rows = [[label, *(f"{parts[config][key]:.2f}" for config in parts)] for key, label in names.items()]
    rows += [["fixed cost ÷ target pass", *(f"{parts[c]['fixed_vs_pass'] * 100:.1f} %" for c in parts)],
             ["tokens per round", *(f"{parts[c]['tokens_per_round']:.2f}" for c in parts)],
             ["tokens/s (÷ the pass's rate in the service)",
              *(f"{parts[c]['tokens_per_s']:.1f} ({parts[c]['plain_vs_pass']:.2f})" for c in parts)]]
    if "engine_alone" in run:
        rows.append([f"÷ the engine decoding alone ({run['engine_alone']['tokens_per_s']:.1f} tok/s)",
                     *(f"{parts[c]['vs_engine_alone']:.2f}" for c in parts)])
    settings = run["settings"]
    head = para(f"`results/{name}.json`: {run['machine']['cpu']} ({'/'.join(run['machine']['vector_extensions'])}), "
                f"prompts {', '.join(settings['prompts'])}; "
                f"{settings['tokens']} tokens less 1, {settings['repeats']}× each; {run['duration_s'] / 60:.1f} min. "
                "Milliseconds per steady-state round:") + "\n"
    return head + table(["part", *parts], rows)


def load_runs(name: str) -> Callable[[Path], str]:
    return lambda results: load_block(results, name)


def load_block(results: Path, name: str) -> str:
    """Aggregate tokens/s with N sessions at once, plain and adaptive (specd bench --load)."""
    run = load(results, name)
    rows = [[n, f"{r['plain_tokens_per_s']:.1f}", f"{r['adaptive_tokens_per_s']:.1f}", f"{r['adaptive_vs_plain']:.2f}×",
             " / ".join(f"{x:.2f}×" for x in r.get("adaptive_vs_plain_by_repeat", ())) or "–",
             "yes" if r["met"] else "no"] for n, r in run["sessions"].items()]
    settings, lossless, adaptive = run["settings"], run["lossless"], run["adaptive"]
    head = para(f"`results/{name}.json`: {run['machine']['cpu']}; `{settings['prompts']}`, {settings['tokens']} "
                f"tokens a request, {settings['repeats']} repeats in alternating order; {run['duration_s'] / 60:.1f} min.") + "\n"
    tail = para(f"Adaptive drafted {adaptive['drafted_tokens']} tokens in {adaptive['rounds']} rounds, "
                f"{adaptive['accepted_tokens']} accepted, {adaptive['fallbacks']} fallbacks to plain; "
                f"{lossless['checked'] - len(lossless['mismatches'])} of {lossless['checked']} adaptive outputs "
                "equal plain decoding's." + _load_cpu(run["sessions"]))
    return head + table(["sessions at once", "plain tok/s", "adaptive tok/s", "adaptive ÷ plain", "each repeat",
                         "≥ 0.98×"], rows) + "\n" + tail


def _load_cpu(sessions: dict) -> str:
    """Each service's CPU a token, plain / adaptive, where the run recorded it."""
    parts = [f"{n} sessions " + ", ".join(f"{role} {cpu['plain'][role]:.1f} / {cpu['adaptive'][role]:.1f}"
                                          for role in cpu["plain"])
             for n, r in sessions.items() if (cpu := r.get("cpu_ms_per_token"))]
    return " CPU ms a token, plain / adaptive: " + "; ".join(parts) + "." if parts else ""


def _rate_against(configs: dict, config: str, reference: str) -> str:
    """A configuration's tok/s and, in brackets, its ratio to another's in the same run."""
    rate = configs[config]["tokens_per_s"]
    return f"{rate:.1f} ({rate / configs[reference]['tokens_per_s']:.2f})"


BLOCKS: dict[str, Callable[[Path], str]] = {
    "bench_llama": llama("bench_llama"),
    "bench_llama_heldout": llama("bench_llama_heldout"),
    "bench_llama_avx2": llama("bench_llama_avx2"),
    "bench_llama_zen2": llama("bench_llama_zen2"),
    "bench_llama_zen2_asm": llama("bench_llama_zen2_asm"),
    "bench_llama_heldout_zen2": llama("bench_llama_heldout_zen2"),
    "bench_llama_zen3": llama("bench_llama_zen3"),
    "bench_llama_heldout_zen3": llama("bench_llama_heldout_zen3"),
    "bench_llama_xeon": llama("bench_llama_xeon"),
    "bench_llama_xeon_head": llama("bench_llama_xeon_head"),
    "bench_llama_heldout_xeon": llama("bench_llama_heldout_xeon"),
    "bench_repeat": llama("bench_repeat"),
    "bench_repeat_heldout": llama("bench_repeat_heldout"),
    "bench_repeat_target_alone": llama("bench_repeat_target_alone"),
    "bench_repeat_avx2": llama("bench_repeat_avx2"),
    "bench_repeat_xeon": llama("bench_repeat_xeon"),
    "round_parts": round_parts,
    "round_parts_avx2": lambda results: round_parts(results, "round_parts_avx2"),
    "round_parts_xeon": lambda results: round_parts(results, "round_parts_xeon"),
    "round_parts_zen2": lambda results: round_parts(results, "round_parts_zen2"),
    "load_avx2": load_runs("load_avx2"),
    "load_avx2_contends": load_runs("load_avx2_contends"),
    "load_avx2_atload": load_runs("load_avx2_atload"),
    "load_avx2_judged": load_runs("load_avx2_judged"),
    "load_avx2_s40": load_runs("load_avx2_s40"),
    "load_avx2_s40_after": load_runs("load_avx2_s40_after"),
    "load_avx2_s41": load_runs("load_avx2_s41"),
    "load_avx2_s42": load_runs("load_avx2_s42"),
    "load_zen2": load_runs("load_zen2"),
    "load_zen2_recheck": load_runs("load_zen2_recheck"),
    "load_zen3": load_runs("load_zen3"),
    "load_zen3_joined": load_runs("load_zen3_joined"),
    "load_zen4": load_runs("load_zen4"),
    "load_zen4_line": load_runs("load_zen4_line"),
    "load_zen4_guided": load_runs("load_zen4_guided"),
    "load_zen4_s39": load_runs("load_zen4_s39"),
    "load_xeon": load_runs("load_xeon"),
    "load_xeon_after": load_runs("load_xeon_after"),
    "load_xeon_held": load_runs("load_xeon_held"),
    "goals": goals,
    "goals_xeon": lambda results: goals(results, "bench_llama_xeon", "bench_llama_heldout_xeon"),
    "goals_zen2": lambda results: goals(results, "bench_llama_zen2_asm", "bench_llama_heldout_zen2"),
    "goals_zen3": lambda results: goals(results, "bench_llama_zen3", "bench_llama_heldout_zen3"),
    "rows": rows,
    "rows_zen2": rows_against("rows_zen2"),
    "rows_zen3": rows_against("rows_zen3"),
    "head_vocab": head_vocab,
    "chaos": chaos,
    "chaos_real": lambda results: chaos(results, "chaos_real"),
    "abuse": abuse,
    "fallback": fallback,
    "ablation": ablation,
    "before_after": before_after,
    "quality": quality("quality"),
    "quality_gemma": quality("quality_gemma"),
}


def update(text: str, results: Path) -> str:
    """`text` with every generated block rendered again from `results`."""
    names, known = {m.group(2) for m in BLOCK.finditer(text)}, set(BLOCKS)
    if names != known:
        raise ValueError(f"generated blocks: missing {sorted(known - names)}, unknown {sorted(names - known)}")
    return BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group(2)](results) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's blocks are stale")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="the results files")
    parser.add_argument("--readme", type=Path, default=ROOT / "benchmarks" / "README.md", help="the file to rewrite")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    fresh = update(text, args.results)
    if args.check and fresh != text:
        print(f"{args.readme} is stale: run `python -m benchmarks.report`", file=sys.stderr)
        return 1
    if not args.check:
        args.readme.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
