"""`applianced plan` (one appliance, or a fleet with several --url), `applianced plan
replay TRACE.csv`, `applianced profile`."""
from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from appliance.commands.client import (
    DEFAULT_URL, AdminClient, AdminError, add_client_args, tls_from_args,
)


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="capacity plan: prefill/decode split at the SLOs",
                       description="Ask the daemon for its capacity plan (forecast, "
                                   "recommended prefill/decode split, bottleneck); with several "
                                   "--url, the fleet's, per site and in total; or replay a "
                                   "trace through the simulator: plan replay TRACE.csv.")
    add_client_args(p, f"an appliance (default {DEFAULT_URL}); repeat for a fleet view per site")
    _plan_args(p)
    psub = p.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    r = psub.add_parser("replay", help="replay an Azure LLM trace in virtual time (no daemon)",
                        description="Replay a trace (Azure LLM format: TIMESTAMP, "
                                    "ContextTokens, GeneratedTokens) through the simulator on "
                                    "a virtual clock: what the planner would recommend over "
                                    "it, and the TTFT/ITL of that split vs the current one.")
    r.add_argument("trace")
    r.add_argument("--devices", default="sim:8xH100", help="simulated box (default sim:8xH100)")
    r.add_argument("--model-spec", default="llama-3.1-70b-fp8",
                   help="simulator model shape (default llama-3.1-70b-fp8)")
    r.add_argument("--split", default="auto", help="current split P+D (default: the planner's default)")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--config", help="TOML config ([planner] SLOs, [engine] sizes)")
    r.add_argument("--ttft-slo", type=float)
    r.add_argument("--itl-slo", type=float)
    r.add_argument("--start", type=int, default=0, help="first trace row to replay")
    r.add_argument("--count", type=int, help="rows to replay (default: all)")
    r.add_argument("--window", default="5m", help="window of the per-window recommendation")
    r.add_argument("--max-batch-tokens", metavar="auto|N[,...]",
                   help="prefill token budget to replay with: auto (the profile's knee, what "
                        "engine.max_batch_tokens = 0 does), a number, or several to compare, "
                        "e.g. auto,8192 (default: the config's engine.max_batch_tokens)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(run=cmd_replay)
    p.set_defaults(run=cmd_plan)

    q = sub.add_parser("profile", help="measure a step-time profile of the real engine",
                       description="Measure prefill and decode step times of the torch engine "
                                   "on this machine (a short sweep) and store the profile where "
                                   "the planner finds it (STATE_DIR/profiles).")
    q.add_argument("--config")
    q.add_argument("--model", help="checkpoint dir (default: the daemon's default model)")
    q.add_argument("--state-dir")
    q.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    q.add_argument("--repeats", type=int, default=3)
    q.add_argument("--quick", action="store_true", help="fewer points (~10 s)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(run=cmd_profile)


def _plan_args(p) -> None:
    p.add_argument("--horizon", help="forecast horizon, e.g. 24h, 7d (default: [planner] horizon)")
    p.add_argument("--gpu", help="what-if: every GPU of this type (H100, H200, L40S ...)")
    p.add_argument("--ttft-slo", type=float, help="what-if: TTFT SLO (s)")
    p.add_argument("--itl-slo", type=float, help="what-if: ITL SLO (s)")
    p.add_argument("--traffic-x", type=float, help="what-if: traffic times k")
    p.add_argument("--prompt-tokens", type=float, help="what-if: mean prompt tokens")
    p.add_argument("--output-tokens", type=float, help="what-if: mean output tokens")
    p.add_argument("--json", action="store_true")


def _num(x) -> str:
    return "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))


def cmd_plan(args) -> int:
    from appliance.commands.tui import resolve_urls
    params = {"horizon": args.horizon, "gpu": args.gpu, "ttft_slo": args.ttft_slo,
              "itl_slo": args.itl_slo, "traffic_x": args.traffic_x,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    urls = resolve_urls(args.url or [DEFAULT_URL], None)
    if len(urls) > 1:
        return cmd_fleet_plan(urls, args.admin_key, params, args.json, tls_from_args(args))
    data = AdminClient.from_args(args, urls[0]).get("/admin/v1/plan", params)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_plan(data))
    return 0


def fetch_plans(urls: list[str], admin_key: str | None, params: dict, tls=None):
    """(url, plan or None, one-line error or None) per appliance, fetched in parallel:
    one slow or dead appliance costs its own timeout, not the sum."""
    def one(url: str):
        try:
            return url, AdminClient(url, admin_key, tls=tls).get("/admin/v1/plan", params), None
        except AdminError as exc:
            return url, None, str(exc)
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(one, urls))


def cmd_fleet_plan(urls: list[str], admin_key: str | None, params: dict, as_json: bool,
                   tls=None) -> int:
    from appliance.planner.fleet import fleet_plan
    from appliance.planner.fleet_roles import plan_roles
    results = fetch_plans(urls, admin_key, params, tls)
    fleet = fleet_plan(results)
    answered = [(url, plan) for url, plan, _ in results if plan is not None]
    fleet["roles"] = plan_roles(answered) if answered else None
    if as_json:
        print(json.dumps(fleet, indent=2))
    else:
        print(format_fleet(fleet))
        if fleet["roles"] is not None:
            print(format_roles(fleet["roles"]))
    if fleet["fleet"] is None:
        raise AdminError("no appliance answered")
    return 0


def format_fleet(f: dict) -> str:
    n = len(f["appliances"])
    sim = " [SIMULATED]" if f["simulated"] else ""
    lines = [f"fleet capacity plan{sim}: {n} appliance{'s' * (n != 1)} at {len(f['sites'])} "
             f"site{'s' * (len(f['sites']) != 1)} (each sized on its own box, estimated)"]
    if f["appliances"]:
        lines.append(f"{'appliance':<26}{'site':<12}{'model':<20}{'current':>8}{'recommended':>13}"
                     f"{'at peak':>9}  {'bottleneck':<11}{'c_a²':>6}")
        for r in f["appliances"]:
            ca2 = "-" if r["arrival_scv"] is None else f"{r['arrival_scv']:.1f}"
            lines.append(f"{_cut(r['appliance'], 25):<26}{_cut(r['site'], 11):<12}"
                         f"{_cut(str(r['model']), 19):<20}{r['split']['current']:>8}"
                         f"{r['split']['recommended']:>13}{r['split']['at_peak']:>9}  "
                         f"{str(r['bottleneck']):<11}{ca2:>6}")
        lines.append("GPUs per phase: current -> recommended now / at the forecast peak "
                     "(needed now); rho = prefill / decode GPU demand")
        rows = [(f"site {name} ({s['appliances']})", s) for name, s in f["sites"].items()]
        rows.append((f"fleet ({f['fleet']['appliances']})", f["fleet"]))
        for label, s in rows:
            cells = []
            for ph in ("prefill", "decode"):
                need = s["needed"][ph]
                cells.append(f"{ph} {s['current'][ph]} -> {s['recommended'][ph]}/{s['at_peak'][ph]} "
                             f"(need {'n/a' if need is None else f'{need:.2f}'})")
            lines.append(f"  {label:<24}{cells[0]:<34}{cells[1]:<34}rho {_num(s['rho']['now'])} "
                         f"now, {_num(s['rho']['at_peak'])} at peak")
            lines.append(f"  {'':<24}{s['why']}")
    for u in f["unreachable"]:
        lines.append(f"note: {u['url']} left out: {u['error']}")
    return "\n".join(lines)


def format_roles(r: dict) -> str:
    """The fleet's roles ([cluster] role per box), the numbers behind them, what one more
    box would change, and the config to apply."""
    n = r["need"]
    sim = " [SIMULATED]" if r["simulated"] else ""
    w = n["workload"]
    lines = ["", f"roles by box{sim} (estimated; whole boxes per phase, sized for the "
                 f"forecast peak within {n['horizon_s'] / 3600:g} h):",
             f"fleet need: {n['rate']:.2f} req/s (prompt {w['prompt_tokens']:.0f}, output "
             f"{w['output_tokens']:.0f} tokens, c_a² {w['arrival_scv']:.1f}) = "
             f"{n['decode_tps']:.0f} decode tok/s; {n['at']}",
             f"{'appliance':<26}{'shape':<18}{'now':<9}{'role':<9}{'prefill req/s':>14}"
             f"{'decode tok/s':>14}"]
    for b in r["roles"]:
        lines.append(f"{_cut(b['appliance'], 25):<26}{_cut(b['shape'], 17):<18}{b['role_now']:<9}"
                     f"{b['role']:<9}{b['prefill_rps']:>14.2f}{b['decode_tps']:>14.0f}")
    lines.append("  (each box's capacity if the whole box took that phase: "
                 f"{r['roles'][0]['basis']})")
    lines.append(f"why: {r['why']}")
    if not r["fits"]:
        lines.append("short: the fleet cannot meet the forecast at the SLOs with these boxes")
    for x in r["if_added"]:
        h = x["headroom"]
        now = {b["appliance"]: b["role"] for b in r["roles"]}
        moved = [f"{n} -> {role}" for n, role in x["roles"].items() if now.get(n) != role]
        lines.append(f"with one more {x['shape']} box: it takes {x['role']}"
                     + (f" ({', '.join(moved)})" if moved else "")
                     + f"; headroom prefill {_num(h['prefill'])}x, decode {_num(h['decode'])}x"
                     + ("" if x["fits"] else " (still short)"))
    lines.append("config to apply ([cluster] on each box; then restart it):")
    for name, snippet in r["config"].items():
        lines.append(f"  # {name}")
        lines.extend(f"  {line}" for line in snippet.splitlines())
    return "\n".join(lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def format_plan(d: dict) -> str:
    sim = " [SIMULATED]" if d.get("simulated") else ""
    src = d["profile_source"]
    lines = [f"capacity plan for {d['model']}{sim}: SLO TTFT {d['slo']['ttft_s']:g} s, "
             f"ITL {d['slo']['itl_s'] * 1000:g} ms, sized at the p{round(d['quantile'] * 100)} "
             f"forecast, horizon {d['horizon_s'] / 3600:g} h"]
    if d.get("whatif"):
        lines.append("what-if: " + ", ".join(f"{k}={v}" for k, v in d["whatif"].items()))
    lines.append(f"profiles: prefill {src['prefill']['source']} ({src['prefill']['device']} "
                 f"tp{src['prefill']['tp']}), decode {src['decode']['source']} "
                 f"({src['decode']['device']} tp{src['decode']['tp']})")
    w = d["workload"]["now"]
    lines.append(f"now: {w['rate']:.2f} req/s, prompt {w['prompt_tokens']:.0f} tokens, output "
                 f"{w['output_tokens']:.0f} tokens, prefix hit {w['prefix_hit']:.0%}; "
                 f"rho now {_num(d['rho']['now'])} (prefill / decode GPU demand, estimated)")
    lines.append(f"{'':<18}{'prefill':>22}{'decode':>22}")
    for label, s in (("current", d["current"]), ("recommended now", d["recommended"]),
                     ("at forecast peak", d["recommended"]["at_peak"])):
        cells = []
        for ph in ("prefill", "decode"):
            x = s[ph]
            cells.append(f"{x['workers']} wk/{x['gpus']} GPU (need {_num(x['gpus_needed'])})")
        short = "" if s.get("fits", True) else "  (the box is short of what this needs)"
        lines.append(f"{label:<18}{cells[0]:>22}{cells[1]:>22}   {s['split']}{short}")
    h = d["headroom"]["recommended"]
    lines.append(f"headroom at the recommended split: prefill {_num(h['prefill'])}x, decode "
                 f"{_num(h['decode'])}x")
    if b := d.get("burstiness"):
        lines.append(format_burstiness(b, d["current"]["split"], d["recommended"]["split"]))
    lines.append(f"bottleneck: {d['bottleneck']['why']}")
    c = d["cost"]
    lines.append(f"cost: ${c['usd_per_day']:.2f}/day, {c['kwh_per_day']:.1f} kWh/day (estimated)")
    t = d["tuning"]
    lines.append(f"prefill token budget: {t['prefill_token_budget']}: {t['why']}")
    applied = t.get("max_batch_tokens") or {}
    if applied:
        auto = " (auto)" if applied.get("configured") == 0 else ""
        lines.append(f"engine.max_batch_tokens: {applied.get('value')}{auto}, "
                     f"{applied.get('source')}: {applied.get('why', 'from the config')}")
    if d.get("placement"):
        lines.append(f"placement: {d['placement']['why']}")
    f = d["forecast"]
    rate = f["rate"]
    if rate:
        peak = max(rate, key=lambda x: x["upper"])
        lines.append(f"forecast ({f['method']}, {f['history_buckets']} buckets of history, "
                     f"{d['bucket_s'] / 60:g} min buckets): next {rate[0]['mean']:.2f} req/s "
                     f"[{rate[0]['lower']:.2f}, {rate[0]['upper']:.2f}], peak upper "
                     f"{peak['upper']:.2f} req/s")
    return "\n".join(lines)


def format_burstiness(b: dict, current: str, recommended: str) -> str:
    """One line: c_a², c_s², where they came from, and whether they moved the answer."""
    line = (f"burstiness: c_a² {b['arrival_scv']:.2f} (inter-arrival, Poisson = 1), c_s² "
            f"{b['service_scv']:.2f} (prefill time, from the prompt spread)")
    if b.get("source"):
        line += f", {b['source']}"
    t = b.get("ttft_bound") or {}
    if t.get("current_s") is not None or t.get("recommended_s") is not None:
        sec = lambda v: "saturated" if v is None else f"{v:.2f} s"  # noqa: E731
        line += (f"; bound's mean TTFT {sec(t.get('current_s'))} at {current}, "
                 f"{sec(t.get('recommended_s'))} at {recommended}")
    if b.get("drives"):
        line += f"; burstiness drives the recommendation (Poisson arrivals: {b['poisson_split']})"
    return line


def cmd_replay(args) -> int:
    from appliance import config
    from appliance.config import parse_duration
    from appliance.models.specs import lookup_model_spec
    from appliance.planner.replay import load_azure_trace, plan_replay
    from appliance.planner.sizing import Slo
    cfg = config.load(args.config) if args.config else config.Config()
    if args.tp < 1:
        raise ValueError(f"--tp must be 1 or more, got {args.tp}")
    if args.count is not None and args.count < 1:
        raise ValueError(f"--count must be 1 or more, got {args.count}")
    for name in ("ttft_slo", "itl_slo"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")
    slo = Slo(args.ttft_slo or cfg.planner.ttft_slo_s, args.itl_slo or cfg.planner.itl_slo_s)
    budgets = parse_budgets(args.max_batch_tokens) if args.max_batch_tokens else None
    model = lookup_model_spec(args.model_spec)
    trace = load_azure_trace(Path(args.trace), args.start, args.count)
    progress = (lambda line: print(f"  {line}", file=sys.stderr, flush=True)) \
        if not args.json else None
    out = plan_replay(trace, model, args.devices, args.split, args.tp, slo,
                      cfg.planner.quantile, parse_duration(args.window), cfg.engine, progress,
                      budgets)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(format_replay(out))
    return 0


def parse_budgets(text: str) -> list[int]:
    """`auto`, `8192` or `auto,8192` -> [0, 8192] (0 = auto); one ValueError line else."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item == "auto":
            out.append(0)
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            raise ValueError(f"--max-batch-tokens: expected auto, a positive whole number, or "
                             f"several of them comma-separated (auto,8192), got {text!r}")
    return out


def format_replay(r: dict) -> str:
    w = r["workload"]
    lines = [f"replay [SIMULATED, virtual clock]: {r['requests']} requests over "
             f"{r['duration_s'] / 60:.1f} min on {r['devices']}, {r['model']} tp{r['tp']}",
             f"workload: {w['mean']['rate']:.2f} req/s mean, {w['upper']['rate']:.2f} at the "
             f"p{round(r['quantile'] * 100)} minute; prompt {w['mean']['prompt_tokens']:.0f}, "
             f"output {w['mean']['output_tokens']:.1f} tokens; rho {_num(r['rho'])} "
             f"({'prefill' if (r['rho'] or 0) > 1 else 'decode'}-heavy)",
             format_burstiness(r["burstiness"], r["current"], r["recommended"]),
             f"planner: current {r['current']}, recommended {r['recommended']}; {r['why']}",
             f"prefill token budget (profile knee): {r['prefill_token_budget']}",
             f"per {r['window_s'] / 60:g}-minute window:"]
    for x in r["windows"]:
        lines.append(f"  t+{x['t'] / 60:5.0f} min {x['requests']:6d} req {x['rate']:6.2f} req/s "
                     f"(upper {x['rate_upper']:.2f})  c_a² {x['arrival_scv']:6.1f}  "
                     f"rho {_num(x['rho']):>6}  -> {x['recommended']}")
    s = r["slo"]
    lines.append(f"SLO: TTFT {s['ttft_s']:g} s, ITL {s['itl_s'] * 1000:g} ms ({s['checked_at']})")
    lines.append(f"{'split':<8}{'TTFT mean':>10}{'p50':>9}{'p90':>9}{'p99':>9}{'ITL p50':>10}"
                 f"{'p90':>9}{'p99':>9}  meets SLO  | bound's mean TTFT (M/D/1)")
    for split, x in r["replay"].items():
        ms = lambda v: "-" if v is None else f"{v * 1000:.0f}ms"  # noqa: E731
        bound = x.get("bound") or {}
        lines.append(f"{split:<8}{ms(x['ttft_mean_s']):>10}{ms(x['ttft_p50_s']):>9}"
                     f"{ms(x['ttft_p90_s']):>9}{ms(x['ttft_p99_s']):>9}{ms(x['itl_p50_s']):>10}"
                     f"{ms(x['itl_p90_s']):>9}{ms(x['itl_p99_s']):>9}  "
                     f"{'yes' if x['meets_slo'] else 'NO ':<9}  | "
                     f"{ms(bound.get('ttft_mean_s')) if bound.get('ttft_mean_s') else 'saturated'} "
                     f"({ms(bound.get('ttft_mean_poisson_s'))})")
    by_budget = r.get("by_budget") or {}
    if len(by_budget) > 1:
        lines.append("prefill token budget (engine.max_batch_tokens; auto = the profile's knee):")
        lines.append(f"{'budget':<14}{'split':<7}{'TTFT mean':>10}{'p50':>9}{'p90':>9}{'p99':>9}"
                     f"{'ITL p50':>9}{'p90':>8}  prompts/prefill step  meets SLO")
        for label, results in by_budget.items():
            for split, x in results.items():
                budget = f"{label} ({x['max_batch_tokens']})" if label == "auto" else label
                lines.append(f"{budget:<14}{split:<7}{ms(x['ttft_mean_s']):>10}"
                             f"{ms(x['ttft_p50_s']):>9}{ms(x['ttft_p90_s']):>9}"
                             f"{ms(x['ttft_p99_s']):>9}{ms(x['itl_p50_s']):>9}"
                             f"{ms(x['itl_p90_s']):>8}  "
                             f"{x['prefill_batching']['prompts_per_step']:>20.2f}  "
                             f"{'yes' if x['meets_slo'] else 'NO'}")
    elif by_budget:
        x = next(iter(next(iter(by_budget.values())).values()))
        lines.append(f"replayed with max_batch_tokens {r['max_batch_tokens']}"
                     + (f" ({x['max_batch_tokens']} tokens)" if r["max_batch_tokens"] == "auto" else ""))
    return "\n".join(lines)


def cmd_profile(args) -> int:
    import os

    from appliance import config
    from appliance.models.specs import spec_from_hf_config
    from appliance.planner.measure import measure_profile
    from appliance.planner.profiles import save_profile
    from appliance.worker.spec import WorkerSpec
    cfg = config.load(args.config)
    state = config.state_dir(cfg, args.state_dir)
    if args.model or cfg.engine.model:
        model_dir = Path(args.model or cfg.engine.model).expanduser()
    else:
        from appliance.daemon.setup import default_model
        model_dir = default_model(state, lambda line: print(f"  {line}", file=sys.stderr))
    if not (model_dir / "config.json").exists():
        raise ValueError(f"model directory {model_dir} has no config.json")
    model = spec_from_hf_config(model_dir / "config.json", name=cfg.engine.model_name or None)
    threads = args.threads or len(os.sched_getaffinity(0))
    spec = WorkerSpec(worker="profile", role="agg", engine="torch", devices=["cpu0"],
                      device_kind="cpu", model_dir=str(model_dir), cpu_threads=threads,
                      block_size=cfg.engine.block_size, kv_cache_bytes=cfg.engine.kv_cache_bytes)
    say = (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    say(f"profiling {model.name} on the CPU with the torch engine, {threads} thread(s)")
    prof = measure_profile(spec, model, "cpu", repeats=args.repeats, quick=args.quick,
                           progress=say)
    path = save_profile(prof, state / "profiles")
    if args.json:
        print(json.dumps({**prof.to_json(), "path": str(path),
                          "prefill_knee_tokens": prof.prefill_knee_tokens()}, indent=2))
    else:
        print(f"measured profile written to {path}; prefill knee {prof.prefill_knee_tokens()} "
              f"tokens ({prof.prefill_tokens_per_s(prof.prefill_knee_tokens()):.0f} tok/s)")
    return 0
