"""The scene of the allocation tests (issue 22 §2, §3), shared with the FOCUS export's:
8 simulated H100s priced at $3.60/h, prefill on g0-g3 and decode on g4-g7, a real SQLite
ledger written by the real accountant; the energy meter is a stand-in at the hardware
boundary."""
from __future__ import annotations

from appliance.accounting.accountant import Accountant, Site
from appliance.accounting.allocation import Method
from appliance.accounting.attribution import DeviceInfo
from appliance.accounting.carbon import CarbonIntensity, EmbodiedCarbon
from appliance.accounting.cost import PriceBook
from appliance.accounting.ledger import Ledger
from appliance.accounting.records import RequestRecord
from appliance.engines.messages import IterationRecord

T0 = 1_700_000_000.0        # a window boundary for 10 s windows (in the past)
PRICE = 3.60
PUE = 1.56
GRID = 480.0
IDLE_W, ACTIVE_W = 70.0, 550.0
H100_G_PER_S = EmbodiedCarbon({}, {}).grams_per_second("H100-SXM")


class Meter:
    """Each device draws IDLE_W plus ACTIVE_W while busy; windows from `blind_from` on
    have no reading (a device the meter cannot read)."""

    def __init__(self, busy, blind_from: float | None = None):
        self.busy, self.blind_from = busy, blind_from

    def energy_j(self, device, t0, t1):
        if self.blind_from is not None and t0 >= self.blind_from:
            return None, "none"
        on = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.busy.get(device, []))
        return IDLE_W * (t1 - t0) + ACTIVE_W * on, "simulated"

    def idle_power_w(self, device):
        return IDLE_W


def it(worker, phase, start, wall, devices, entries):
    return IterationRecord(worker, phase, start, wall, tuple(devices), False, list(entries), False)


def req(rid, tenant, arrival, finish, prompt=2000, output=100):
    return RequestRecord(rid, tenant, "m", "chat", prompt, output, 0, arrival, arrival + 0.5,
                         finish, "p0", "d0", "ok", "stop")


PRE = [f"g{i}" for i in range(4)]
DEC = [f"g{i}" for i in range(4, 8)]


def ledger_with(tmp_path, runs, end, blind_from=None):
    """`runs`: (request, tenant, start, prefill_s, decode_s); prefill on g0-g3, decode on
    g4-g7. Returns the ledger (closed up to `end`) for reports."""
    devs = [DeviceInfo(f"g{i}", "H100-SXM", "sim", True) for i in range(8)]
    busy: dict[str, list] = {}
    ledger = Ledger(tmp_path / "ledger.db", flush_interval_s=0.05, retention_days=0)
    ledger.start()
    recs = []
    for rid, tenant, t, p_s, d_s in runs:
        recs.append((it("p0", "prefill", t, p_s, PRE, [(rid, 2000, 2000)]),
                     it("d0", "decode", t + p_s, d_s, DEC, [(rid, 1, 2001)]),
                     req(rid, tenant, t - 0.1, t + p_s + d_s)))
        for d in PRE:
            busy.setdefault(d, []).append((t, t + p_s))
        for d in DEC:
            busy.setdefault(d, []).append((t + p_s, t + p_s + d_s))
    acc = Accountant(devs, "m", Site("s1", "app1", "DE", PUE, CarbonIntensity(GRID)), ledger,
                     PriceBook({"H100-SXM": PRICE}, 0.0, "share"), EmbodiedCarbon({}, {}),
                     meter=lambda: Meter(busy, blind_from), window_s=10.0, start=T0)
    for pre, dec, r in recs:
        acc.iteration(pre)
        acc.iteration(dec)
        acc.request(r)
    acc.stop(now=end)
    return Ledger(tmp_path / "ledger.db", retention_days=0)


def method(policy="share", cards=(), per_kwh=0.0, intensity=None, market=None, node_w=0.0):
    return Method(PriceBook({"H100-SXM": PRICE}, per_kwh, policy, cards=list(cards)),
                  EmbodiedCarbon({}, {}), PUE, intensity or CarbonIntensity(GRID), market, node_w)


def capacity_of(led, since, until, rate=lambda t: PRICE, per_kwh=0.0, node_w=0.0):
    """The devices' capacity cost of [since, until), straight from the device windows
    (each clipped to the window): device-seconds × rate + facility energy × price."""
    cost = 0.0
    spans = set()
    for start, end, meas_s, meas_j in led.query(
            'SELECT start, "end", measured_gpu_s, measured_j FROM device_windows'):
        a, b = max(start, since), min(end, until)
        if b <= a:
            continue
        f = (b - a) / (end - start)
        cost += meas_s * f * rate(a) / 3600 + (meas_j or 0.0) * f * PUE / 3.6e6 * per_kwh
        spans.add((a, b))
    cost += sum(b - a for a, b in spans) * node_w * PUE / 3.6e6 * per_kwh
    return cost


def box_ledger(path, role: str, runs, start: float, end: float, site: Site,
               peer: str = "http://decode-box:8000"):
    """One box of a prefill/decode pair (issue 29), its ledger at `path` written by the
    real accountant. `runs`: (request, tenant, t, prefill_s, decode_s), the same on both
    boxes. The front ("prefill") runs each prompt on g0-g3 and writes the request's row
    (its decode on the peer); the decode box ("decode") runs each decode on g4-g7 and
    writes a `cluster_decode` row under the same request id, tenant and model."""
    devs = [DeviceInfo(f"g{i}", "H100-SXM", "sim", True) for i in range(8)]
    busy: dict[str, list] = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(path, flush_interval_s=0.05, retention_days=0)
    ledger.start()
    acc = Accountant(devs, "m", site, ledger, PriceBook({"H100-SXM": PRICE}, 0.0, "share"),
                     EmbodiedCarbon({}, {}), meter=lambda: Meter(busy), window_s=10.0,
                     start=start)
    for rid, tenant, t, p_s, d_s in runs:
        if role == "prefill":
            acc.iteration(it("p0", "prefill", t, p_s, PRE, [(rid, 2000, 2000)]))
            rec = RequestRecord(rid, tenant, "m", "chat", 2000, 100, 0, t - 0.1, t + p_s,
                                t + p_s + d_s, "p0", f"peer:{peer}", "ok", "stop")
            devices, span = PRE, (t, t + p_s)
        else:
            acc.iteration(it("d0", "decode", t + p_s, d_s, DEC, [(rid, 1, 2001)]))
            rec = RequestRecord(rid, tenant, "m", "cluster_decode", 2000, 100, 0, t + p_s,
                                t + p_s, t + p_s + d_s, None, "d0", "ok", "stop")
            devices, span = DEC, (t + p_s, t + p_s + d_s)
        for d in devices:
            busy.setdefault(d, []).append(span)
        acc.request(rec)
    acc.stop(now=end)
