"""The console's screens, one module (and one .tcss) each, keyed by mode name."""
from appliance.tui.screens.capacity import CapacityScreen
from appliance.tui.screens.carbon import CarbonScreen
from appliance.tui.screens.fleet import FleetScreen
from appliance.tui.screens.optional import WorkflowsScreen
from appliance.tui.screens.overview import OverviewScreen
from appliance.tui.screens.tenants import TenantsScreen

SCREENS = {"overview": OverviewScreen, "tenants": TenantsScreen, "carbon": CarbonScreen,
           "capacity": CapacityScreen, "workflows": WorkflowsScreen, "fleet": FleetScreen}
