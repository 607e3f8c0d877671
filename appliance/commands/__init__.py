"""CLI subcommands beyond the core ones, one module per area.

Each module has `add_parsers(sub)`, which adds its subcommands and sets `run` on each
(`p.set_defaults(run=function)`); `appliance.cli` lists the modules in `AREAS`. A
command talks to the daemon through `commands.client`, never by importing it.
"""
