"""The frozen binary's entry point: the same CLI as `python -m appliance`.

`serve`, `tui` and the internal `worker` and `model ensure-default` are all this one
program; the daemon re-executes `sys.executable` (this binary) for its workers."""
from appliance.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
