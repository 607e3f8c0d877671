"""`?`: the keys and the screens."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
applianced tui — keys

  1 Overview   prefill:decode ratio, devices by group, workers
  2 Tenants    who spends the GPU budget
               s/S sort, t period 1h/24h/7d, g by tenant/team/project/
               cost centre, / filter
  3 Carbon     intensity, provenance, SCI per 1k tokens
  4 Capacity   the planner's view (when the daemon has it)
  5 Workflows  workflows (when the daemon has them)
  6 Fleet      every --url: fleet ratio, sites, top tenants

  q quit   ? help   p pause   r refresh now   a next appliance

SIMULATED: a figure comes from simulated devices.
ESTIMATED: a figure is modelled, not measured.

Esc or ? closes this."""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help { width: auto; max-width: 90%; height: auto; border: round $accent;
            padding: 0 1; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")

    def action_dismiss(self) -> None:
        self.dismiss()
