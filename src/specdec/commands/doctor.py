"""`specdec doctor`: tell an integration fault from a weak drafter from overhead, with evidence."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Find out why a drafter accepts what it accepts. In order:

  1. static checks (seconds): the drafter fits the target; each serving engine's reading of the
     folder (vLLM 0.34.0 / SGLang 0.5.23 loading rules, specdec/engine_rules.py) feeds the states
     it was trained on; the vocab mapping is not lost; and against what `specdec train` recorded:
     the chat template and tokenizer, the target's weights, the drafter's weight norms.
  2. with --server URL (any OpenAI-compatible vLLM, SGLang or specdec server serving this target
     and drafter): the same prompts, greedy, through the server's API and through specdec's engine
     at the server's k; live acceptance (from /metrics counter deltas over exactly these requests)
     against that reference, per position with 95% intervals and paired per prompt. Far below it
     is an integration fault: the sweep then finds the switch that reproduces the live figure (aux
     ids shifted, an aux state missing, the other residual convention, a lost d2t, ...).
  3. without --server: the sweep itself: acceptance under each hypothesis, each row saying whether
     the switch changes acceptance on this target at all.
  The sweep generates nothing again: greedy decoding is lossless, so each hypothesis is measured
  on the reference's own text, as the engine would count it, on the same positions (a paired
  comparison). Prompts are taken one at a time until the answer is clear (at least 3, at most
  --limit).

verdicts: integration (the server feeds the drafter something else), drafter/data (server and
reference agree, both low), overhead (acceptance as expected, speculation still predicted to
lose), a failed static check or a named mismatch, healthy.
exit status: 0 healthy; 1 a problem found; 2 doctor could not run.

examples:
  specdec doctor --target smollm2-135m-instruct --drafter runs/quickstart/train/drafter
  specdec doctor --target smollm2-135m-instruct --drafter DIR --server http://127.0.0.1:8000 --limit 4
  specdec doctor --target ./Llama-3.1-8B-Instruct --drafter ./eagle3 --engine sglang --checks-only --json
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="tell an integration fault from a weak drafter from overhead",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target the drafter serves with (registry name, folder, .gguf)")
    p.add_argument("--drafter", required=True, metavar="DIR", help="the drafter folder (eagle3 or speculators)")
    p.add_argument("--server", metavar="URL", help="a live server serving this target and drafter: compare with it")
    p.add_argument("--model", help="model name to send to --server (default: the first of its /v1/models)")
    p.add_argument("--api-key", help="bearer key for --server")
    p.add_argument("--engine", choices=["vllm", "sglang", "both", "specdec"], default="both",
                   help="which engines' reading of the folder the static checks judge (default: both; "
                        "specdec: none, the drafter runs on specdec's engine only)")
    p.add_argument("--capture", metavar="DIR",
                   help="the capture the drafter was trained on (default: the one train recorded, if it is still "
                        "there): recompute a few samples' aux states with the target now and compare")
    p.add_argument("--checks-only", action="store_true", help="static checks only (no model runs)")
    p.add_argument("--prompts", default="mt-bench",
                   help="mt-bench (default), humaneval, gsm8k, sharegpt, or a .json/.jsonl file of conversations")
    p.add_argument("--limit", type=int, default=12,
                   help="at most this many prompts; doctor stops sooner once the answer is clear (default: 12)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt (default: 48)")
    p.add_argument("--k", type=int, default=5, help="draft tokens per step without --server (default: 5)")
    p.add_argument("--device")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: verdict, exit_code, checks, live, reference, sweep, recommendation")
    p.set_defaults(func=run)


def _engines(choice: str) -> tuple[str, ...]:
    return {"both": ("vllm", "sglang"), "specdec": ()}.get(choice, (choice,))


def _overhead(live: dict) -> dict | None:
    """Acceptance as expected, but is speculation predicted to pay at this k? (cost ratio assumed)"""
    from ..diagnose import theory

    curve = live.get("per_position_acceptance") or []
    k = live.get("k")
    if not curve or not k:
        return None
    e = live["mean_acceptance_length"]
    c = theory.DEFAULT_COST_RATIO
    s = theory.speedup(e, k, c)
    best = theory.best_k(curve, c)
    return {"predicted_speedup": s, "cost_ratio": c, "cost_ratio_assumed": True,
            "recommended_k": best.k if best else None, "recommended_speedup": best.speedup if best else None}


def _measured(used: int, offered: int, early: bool) -> str:
    return (f"{used} of {offered} prompts: the answer was clear" if early
            else f"{used} prompts")


def diagnose_all(args) -> dict:
    from ..data.datasets import load_conversations
    from ..doctor import diagnose_drafter
    from ..doctor.checks import FAIL, static_checks
    from ..errors import SpecdecError
    from ..doctor.live import DRAFTER, HEALTHY, INTEGRATION, OVERHEAD, compare, explain, measure
    from ..models.target import load_target

    target = load_target(args.target, device=args.device)
    checks, drafter = static_checks(args.drafter, target, _engines(args.engine))
    states = None
    recorded = (drafter.cfg.provenance or {}).get("capture") if drafter is not None else None
    capture = args.capture or recorded
    if capture and drafter is not None and not args.checks_only:
        from pathlib import Path

        from ..doctor.checks import capture_check

        if (Path(capture) / "manifest.json").is_file():
            check, states = capture_check(target, drafter.to(device=target.device, dtype=target.dtype), capture)
            checks.append(check)
        elif args.capture:
            raise SpecdecError(f"--capture {capture}: no manifest.json there; expected a `specdec capture` folder")
    out = {"checks": [c.as_dict() for c in checks], "live": None, "reference": None, "sweep": None,
           "recommendation": None, "states": states}
    failed = [c for c in checks if c.status == FAIL]
    if drafter is None or args.checks_only:
        if failed:
            c = failed[0]
            out.update(verdict=f"{c.name}: {c.detail}", recommendation=c.fix, exit_code=1)
        else:
            out.update(verdict="static checks pass (nothing was run: --checks-only)", exit_code=0)
        return out
    drafter = drafter.to(device=target.device, dtype=target.dtype)
    if args.limit < 1:
        raise SpecdecError(f"--limit {args.limit}: expected at least 1 prompt")
    convs = load_conversations(args.prompts, limit=args.limit, seed=0)
    progress = not args.json
    if args.server:
        live, ref, early = measure(args.server, target, drafter, convs, max_tokens=args.max_new_tokens,
                                   model=args.model, api_key=args.api_key, progress=progress)
        reference = ref.summary()
        heldout = ((drafter.cfg.provenance or {}).get("heldout") or {}).get("walked_acceptance_length_k5")
        result = compare(live, reference, heldout_al=heldout)
        result["measured"] = _measured(len(ref.texts), len(convs), early)
        out.update(live=live, reference=reference, comparison=result)
        verdict, why = result["verdict"], result["why"] + f" ({result['measured']})"
        if verdict == INTEGRATION:
            found = explain(live, target, drafter, ref)
            out["sweep"] = found
            if found["match"]:
                m = found["match"]
                why += (f"; fed {m['fed']} instead of the trained hidden_states{list(drafter.cfg.aux_layer_ids)} "
                        f"('{m['hypothesis']}'), specdec's engine accepts {m['mean_acceptance_length']:.2f}, as the "
                        f"server does")
                out["recommendation"] = m["fix"]
            else:
                why += "; no single switch of the sweep reproduces the live figure"
        elif verdict == HEALTHY:
            over = _overhead(live)
            out["overhead"] = over
            if over and over["predicted_speedup"] < 1:
                verdict = OVERHEAD
                why += (f", but at k = {live['k']} a step is predicted to lose ({over['predicted_speedup']:.2f}x at "
                        f"an assumed cost ratio c = {over['cost_ratio']:g}); k = {over['recommended_k']} predicts "
                        f"{over['recommended_speedup']:.2f}x")
                out["recommendation"] = f"serve with k = {over['recommended_k']} and measure (specdec bench)"
        elif verdict == DRAFTER:
            out["recommendation"] = "train on more data, or on data closer to the served traffic, then compare again"
        if failed and verdict in (HEALTHY, DRAFTER):
            verdict, why = "static check failed", f"{failed[0].name}: {failed[0].detail}"
            out["recommendation"] = failed[0].fix
        out.update(verdict=f"{verdict}: {why}", exit_code=0 if verdict == HEALTHY else 1)
        return out
    sweep = diagnose_drafter(target, drafter, convs, k=args.k, max_new_tokens=args.max_new_tokens, progress=progress)
    out.update(sweep=sweep, reference=sweep["baseline"])
    if failed:
        c = failed[0]
        out.update(verdict=f"static check failed: {c.name}: {c.detail}", recommendation=c.fix, exit_code=1)
    elif sweep["mismatch"]:
        row = next(r for r in sweep["rows"] if r["hypothesis"] == sweep["mismatch"])
        out.update(verdict=sweep["verdict"], recommendation=row["fix"], exit_code=1)
    else:
        out.update(verdict=f"healthy as far as specdec's engine can tell: {sweep['verdict']}", exit_code=0)
    return out


def _print(args, out: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(highlight=False, soft_wrap=True)
    marks = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
    table = Table(title=f"static checks: {args.drafter} on {args.target}")
    table.add_column("check")
    table.add_column("")
    table.add_column("detail")
    for c in out["checks"]:
        table.add_row(c["name"], marks[c["status"]], escape(c["detail"]))
    con.print(table)
    if out.get("comparison"):
        t = Table(title=f"live {args.server} vs specdec's engine, same prompts, k = {out['live']['k']}")
        for col in ("position", "live", "95% interval", "reference", "95% interval", ""):
            t.add_column(col, justify="right" if col != "" else "left")
        for r in out["comparison"]["positions"]:
            t.add_row(str(r["position"]), f"{100 * r['live']:.1f}%", f"{100 * r['live_ci'][0]:.0f}-"
                      f"{100 * r['live_ci'][1]:.0f}%", f"{100 * r['reference']:.1f}%",
                      f"{100 * r['reference_ci'][0]:.0f}-{100 * r['reference_ci'][1]:.0f}%",
                      "[red]below[/]" if r["live_below_reference"] else "")
        con.print(t)
    sweep = out.get("sweep")
    if sweep and sweep.get("rows") and out.get("comparison"):
        t = Table(title=f"which switch reproduces the live {out['live']['mean_acceptance_length']:.2f} "
                        f"(each walked on the reference's text)")
        for col in ("hypothesis", "acceptance length", "+/- (3 se)", "live - switch, per prompt", "reproduces live"):
            t.add_column(col, justify="left" if col == "hypothesis" else "right")
        for r in sweep["rows"]:
            t.add_row(r["hypothesis"], f"{r['mean_acceptance_length']:.2f}", f"{3 * r['se']:.2f}",
                      f"{r['live_minus_hypothesis']:+.2f} +/- {3 * r['paired_se']:.2f}",
                      "yes" if r["reproduces_live"] else "")
        con.print(t)
    elif sweep and sweep.get("rows"):
        base = sweep["baseline"]
        t = Table(title=f"acceptance under each hypothesis, walked on the text of specdec's engine (as configured "
                        f"there: {base['mean_acceptance_length']:.2f} over {base['num_drafts']} steps)")
        t.add_column("hypothesis")
        t.add_column("acceptance length", justify="right")
        t.add_column("+/- (3 se)", justify="right")
        t.add_column("paired per position: depth, first draft +/-", justify="right")
        t.add_column("moves acceptance here")
        for r in sweep["rows"]:
            moves = r.get("changes_acceptance")
            paired = (f"{r['paired_difference']:+.2f} +/- {3 * r['paired_se']:.2f}, +{r['first_draft_better']}/"
                      f"-{r['first_draft_worse']}" if "paired_difference" in r else "")
            t.add_row(r["hypothesis"], f"{r['mean_acceptance_length']:.2f}", f"{3 * r.get('se', 0):.2f}", paired,
                      "" if moves is None else ("yes" if moves else "no: such a fault would not show"))
        con.print(t)
    colour = "green" if out["exit_code"] == 0 else "red"
    con.print(f"[bold {colour}]{escape(out['verdict'])}[/]")
    if out.get("recommendation"):
        con.print(f"fix: {escape(out['recommendation'])}")


def run(args) -> int:
    import json

    out = diagnose_all(args)
    if args.json:
        print(json.dumps(out, default=str))
    else:
        _print(args, out)
    return out["exit_code"]
