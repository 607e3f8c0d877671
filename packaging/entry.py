"""The frozen binary's entry point: the same CLI as `python -m appliance`.

`serve`, `tui` and the internal `worker` and `model ensure-default` are all this one
program; the daemon re-executes `sys.executable` (this binary) for its workers. The
request-preparation pool's children (multiprocessing, spawn) start here too, so
`freeze_support()` must run before the CLI parses their arguments."""
import multiprocessing

from appliance.cli import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    raise SystemExit(main())
