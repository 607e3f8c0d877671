"""`applianced` command line. Every failure is one line on stderr and a non-zero exit."""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from pathlib import Path

from appliance import __version__
from appliance.commands.client import AdminClient, AdminError, add_client_args
from appliance.tui.views.overview import core_ranges  # noqa: F401  (tests and scripts import it here)

# Subcommand modules under appliance/commands/ (see its __init__): one line per area.
AREAS: tuple[str, ...] = ("keys", "plan", "tenants", "tui", "usage", "workflow")


def _serve_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config (default /etc/applianced/config.toml if present)")
    p.add_argument("--devices", help="auto | cpu | sim:8xH100 | sim:4xH100+4xL40S ...")
    p.add_argument("--split", help="auto | P+D: prefill and decode worker counts")
    p.add_argument("--mode", choices=["disagg", "agg"], help="disaggregated (default) or aggregated")
    p.add_argument("--tp", type=int, help="devices per worker (tensor parallel size)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="applianced",
                                     description="On-prem LLM inference appliance.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("serve", help="run the daemon", description="Run the daemon.")
    _serve_overrides(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--engine", choices=["auto", "torch", "sim", "trtllm"])
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: generated tiny model)")
    p.add_argument("--model-name", help="name served on /v1/models")
    p.add_argument("--model-spec", help="simulator model shape, e.g. llama-3.1-70b-fp8")
    p.add_argument("--sim-speed", type=float, help="simulated time runs this many times faster")
    p.add_argument("--state-dir", help="state directory (default /var/lib/applianced or XDG)")
    p.add_argument("--log-requests", action="store_true", help="log one JSON line per request")

    p = sub.add_parser("devices", help="show devices and the partition plan",
                       description="Show the devices and how they would be split.")
    _serve_overrides(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("model", help="model tools", description="Model tools.")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    q = msub.add_parser("init-tiny", help="write a small generated Llama checkpoint",
                        description="Write a small Llama checkpoint with seeded random weights "
                                    "and a BPE tokenizer trained offline.")
    q.add_argument("dir")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--preset", choices=["tiny", "20m", "82m"], default="tiny")
    q = msub.add_parser("ensure-default", help="(internal) create the default model in a state dir",
                        description="Internal: `serve` runs this once to build its default model.")
    q.add_argument("state_dir")

    p = sub.add_parser("status", help="ask a running daemon for its status",
                       description="Ask a running daemon for its status.")
    add_client_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("config", help="configuration tools", description="Configuration tools.")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    q = csub.add_parser("check", help="validate a config file", description="Validate a config file.")
    q.add_argument("file")

    p = sub.add_parser("key", help="API key tools", description="API key tools.")
    ksub = p.add_subparsers(dest="key_command", metavar="SUBCOMMAND", required=True)
    q = ksub.add_parser("digest", help="print the SHA-256 digest to put in [auth.keys]",
                        description="Print the SHA-256 digest of an API key for [auth.keys].")
    q.add_argument("key")

    sub.add_parser("version", help="print the version", description="Print the version.")

    p = sub.add_parser("worker", help="(internal) run one engine worker",
                       description="Internal: started by the daemon, not by hand.")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--spec", required=True)
    p = sub.add_parser("accountant", help="(internal) run the accounting process",
                       description="Internal: started by the daemon, not by hand.")
    p.add_argument("--fd", type=int, required=True)
    for area in AREAS:
        importlib.import_module(f"appliance.commands.{area}").add_parsers(sub)
    return parser


def _config(args):
    from appliance import config
    cfg = config.load(getattr(args, "config", None))
    for attr, section, key in [("devices", "devices", "spec"), ("split", "devices", "split"),
                               ("mode", "devices", "mode"), ("tp", "devices", "tp"),
                               ("host", "server", "host"), ("port", "server", "port"),
                               ("engine", "engine", "kind"), ("model", "engine", "model"),
                               ("model_name", "engine", "model_name"),
                               ("model_spec", "engine", "model_spec"),
                               ("sim_speed", "engine", "sim_speed")]:
        value = getattr(args, attr, None)
        if value is not None:
            setattr(getattr(cfg, section), key, value)
    if getattr(args, "log_requests", False):
        cfg.server.log_requests = True
    return config.validate(cfg)


def cmd_serve(args) -> int:
    from appliance import config
    from appliance.daemon.main import serve
    cfg = _config(args)
    if cfg.cluster.role != "both":
        # A box that joins another moves KV with NIXL: found here without importing it.
        from appliance.kv.nixl_transport import INSTALL_HINT, nixl_installed
        if not nixl_installed():
            raise config.ConfigError(f"cluster.role = {cfg.cluster.role!r} moves KV between "
                                     f"boxes with NIXL. {INSTALL_HINT}")
    path = args.config or (config.DEFAULT_CONFIG_PATH if config.DEFAULT_CONFIG_PATH.exists()
                           else None)
    return serve(cfg, config.state_dir(cfg, args.state_dir),
                 Path(path).resolve() if path else None)


def cmd_devices(args) -> int:
    from appliance.partitions import discover, format_devices, inventory_json, plan_partition
    cfg = _config(args)
    inv = discover(cfg.devices.spec)
    plan = plan_partition(inv, tp=cfg.devices.tp, split=cfg.devices.split, mode=cfg.devices.mode,
                          cpu_threads=cfg.engine.cpu_threads)
    if args.json:
        print(json.dumps(inventory_json(inv, plan), indent=2))
    else:
        print(format_devices(inv, plan))
    return 0


def cmd_model(args) -> int:
    from appliance.models.tiny import ensure_default_model, init_tiny
    progress = lambda line: print(f"  {line}", file=sys.stderr, flush=True)  # noqa: E731
    if args.model_command == "ensure-default":
        ensure_default_model(Path(args.state_dir), progress=progress)
        return 0
    print(init_tiny(Path(args.dir), seed=args.seed, preset=args.preset, progress=progress))
    return 0


def cmd_status(args) -> int:
    from appliance.tui.views.overview import overview_from_status, render_overview_text
    data = AdminClient.from_args(args).get("/admin/v1/status")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(render_overview_text(overview_from_status(data)))
    return 0


def cmd_config(args) -> int:
    from appliance import config
    cfg = config.load(args.file)
    if cfg.cluster.role != "both":
        # A box that joins another must move KV: prove NIXL loads (plugins and UCX's
        # transports found, in the single binary too) and reads bytes exactly.
        from appliance.kv.nixl_transport import KvTransferError, NixlUnavailable, loopback_check
        try:
            got = loopback_check()
        except (NixlUnavailable, KvTransferError, RuntimeError) as exc:
            raise config.ConfigError(f"{args.file}: cluster.role = {cfg.cluster.role!r} needs "
                                     f"NIXL, which fails here: {exc}") from None
        print(f"{args.file}: ok; NIXL read {got['bytes'] // 1024} KiB between two local "
              f"agents over {got['backend']}, exact, in {got['seconds'] * 1000:.0f} ms")
        return 0
    print(f"{args.file}: ok")
    return 0


def cmd_key(args) -> int:
    print(hashlib.sha256(args.key.encode()).hexdigest())
    return 0


def cmd_accountant(args) -> int:
    from appliance.accounting.process import run
    return run(args.fd)


def cmd_worker(args) -> int:
    from appliance.worker.main import run
    from appliance.worker.spec import WorkerSpec
    return run(args.fd, WorkerSpec.from_json(args.spec))


COMMANDS = {"serve": cmd_serve, "devices": cmd_devices, "model": cmd_model,
            "status": cmd_status, "config": cmd_config, "key": cmd_key, "worker": cmd_worker,
            "accountant": cmd_accountant,
            "version": lambda args: print(f"applianced {__version__}") or 0}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run = getattr(args, "run", None) or COMMANDS[args.command]
        return run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:     # `applianced devices --json | head`
        return 0
    except (ValueError, AdminError) as exc:   # ConfigError, PlanError, no daemon: one line
        print(f"applianced: {exc}", file=sys.stderr)
        return 1
