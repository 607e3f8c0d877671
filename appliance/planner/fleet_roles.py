"""Which boxes of a fleet should be `prefill` and which `decode` ([cluster] role), sized
for the fleet's forecast (issue 29, docs/operations/cluster.md "Planning a fleet").

Disaggregation pays most with whole boxes per phase, so a box takes one role. Each box
is costed with the same sizing model as its own plan (`sizing`: a prefill worker's
requests/s at the TTFT SLO by Kingman's bound, a decode worker's tokens/s at the ITL
SLO), on the profile of its GPU kind, at the *fleet's* workload: the prompt mix a prefill
box will see is everyone's, not its own. The assignment maximises the smaller of the two
headrooms (capacity / need); a box with more prefill per unit of decode (its
comparative advantage: FLOP/s per byte/s of bandwidth) goes to prefill first. One box
alone keeps `both`.

Pure functions on plan JSON (each appliance's `GET /admin/v1/plan`); fetching is the
CLI's business. Everything here is an estimate from profiles (simulated where they say so).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace

from appliance.planner.sizing import Slo, Workload, decode_need, prefill_need

ROLES = ("prefill", "decode")
EXHAUSTIVE_UP_TO = 12           # boxes: all 2^n assignments; beyond, cuts of the ranked order


@dataclass(frozen=True)
class BoxCapacity:
    """What one whole box serves in each role at the fleet's workload and SLOs."""

    url: str
    name: str                   # the appliance's name ([site] appliance, else its URL)
    shape: str                  # e.g. "8xH100 tp1"
    gpus: int
    prefill_rps: float          # requests/s at the TTFT SLO if the whole box prefills
    decode_tps: float           # tokens/s at the ITL SLO if the whole box decodes
    basis: str                  # where the capacities came from
    role_now: str = "both"

    @property
    def prefill_bias(self) -> float:
        """Prefill req/s per decode token/s: higher = relatively better at prefill."""
        return self.prefill_rps / self.decode_tps if self.decode_tps > 0 else math.inf


@dataclass(frozen=True)
class FleetNeed:
    """The fleet's load at the forecast peak: requests/s through prefill, tokens/s of decode."""

    rate: float
    decode_tps: float
    workload: dict
    slo: dict


@dataclass
class Assignment:
    roles: dict                 # box name -> "prefill" | "decode" | "both"
    capacity: dict              # role -> req/s (prefill) or tokens/s (decode)
    headroom: dict              # role -> capacity / need (None: no need)
    fits: bool

    @property
    def score(self) -> float:
        hs = [math.inf if h is None else h for h in self.headroom.values()]
        return min(hs)


def _headroom(capacity: float, need: float) -> float | None:
    return None if need <= 0 else capacity / need


def evaluate(boxes: list[BoxCapacity], roles: dict, need: FleetNeed) -> Assignment:
    cap = {"prefill": sum(b.prefill_rps for b in boxes if roles[b.name] in ("prefill", "both")),
           "decode": sum(b.decode_tps for b in boxes if roles[b.name] in ("decode", "both"))}
    head = {"prefill": _headroom(cap["prefill"], need.rate),
            "decode": _headroom(cap["decode"], need.decode_tps)}
    fits = all(h is None or h >= 1.0 for h in head.values())
    return Assignment(roles, cap, head, fits)


def _candidates(boxes: list[BoxCapacity]):
    """Role maps with at least one box per role: every one for a small fleet, else each
    cut of the boxes ranked by prefill bias (the best prefill boxes first)."""
    names = [b.name for b in boxes]
    if len(boxes) <= EXHAUSTIVE_UP_TO:
        for bits in itertools.product(ROLES, repeat=len(boxes)):
            if len(set(bits)) == 2:
                yield dict(zip(names, bits))
        return
    ranked = sorted(boxes, key=lambda b: -b.prefill_bias)
    for k in range(1, len(boxes)):
        yield {b.name: ("prefill" if i < k else "decode") for i, b in enumerate(ranked)}


def assign(boxes: list[BoxCapacity], need: FleetNeed) -> Assignment:
    """The role of each box that maximises the smaller headroom. Ties (e.g. no traffic)
    go to the assignment that gives prefill the boxes with the most prefill bias, then to
    the one changing the fewest boxes' current roles."""
    if not boxes:
        raise ValueError("no boxes to assign")
    names = [b.name for b in boxes]
    if len(set(names)) != len(names):
        raise ValueError("two boxes have the same name: give each its own [site] appliance")
    if len(boxes) == 1:
        return evaluate(boxes, {boxes[0].name: "both"}, need)
    bias = {b.name: b.prefill_bias for b in boxes}
    now = {b.name: b.role_now for b in boxes}

    def key(a: Assignment) -> tuple:
        pre = [bias[n] for n, r in a.roles.items() if r == "prefill"]
        dec = [bias[n] for n, r in a.roles.items() if r == "decode"]
        ordered = min(pre) >= max(dec)              # no decode box better suited to prefill
        changed = sum(a.roles[n] != now[n] for n in names)
        # 1e-9: equal headrooms computed in another order must tie
        return (round(a.score, 9) if math.isfinite(a.score) else math.inf, ordered, -changed)

    return max((evaluate(boxes, roles, need) for roles in _candidates(boxes)), key=key)


def fleet_need(plans: list[dict]) -> FleetNeed:
    """The fleet's load at each box's forecast peak (the upper quantile), added up: all
    of it passes through the prefill boxes and all of its tokens through the decode boxes.
    Peaks are summed as if they coincided (conservative). Token means and burstiness are
    weighted by each box's rate; the SLOs are the strictest of the boxes'."""
    ws = [p["workload"]["upper_peak"] for p in plans]
    rate = sum(w["rate"] for w in ws)

    def mean(field: str, default: float) -> float:
        if rate <= 0:
            return sum(w[field] for w in ws) / len(ws) if ws else default
        return sum(w[field] * w["rate"] for w in ws) / rate

    w = Workload(rate, mean("prompt_tokens", 512.0), mean("output_tokens", 128.0),
                 mean("prefix_hit", 0.0), mean("arrival_scv", 1.0), mean("prompt_scv", 0.0))
    slo = Slo(min(p["slo"]["ttft_s"] for p in plans), min(p["slo"]["itl_s"] for p in plans))
    return FleetNeed(rate, rate * w.output_tokens, asdict(w), asdict(slo))


def box_capacity(url: str, plan: dict, need: FleetNeed, name: str | None = None) -> BoxCapacity:
    """A box's whole-box capacities at the fleet's workload, from the profile of its GPU
    kind (the plan's `box` section: model shape, devices, tp); when its model is not in
    the catalogue or its profile was measured, from its own plan's per-worker figures
    (which are at its own workload, and the basis says so)."""
    box = plan.get("box") or {}
    name = name or appliance_name(url, plan)
    groups = box.get("workers") or []
    tp = int(box.get("tp") or 1)
    shape = " + ".join(f"{g['count'] * tp}x{g['device']}" for g in groups) + f" tp{tp}" \
        if groups else "?"
    gpus = sum(g["count"] for g in groups) * tp
    w = Workload(**need.workload)
    slo = Slo(**need.slo)
    profiles = _profiles(box, groups)
    if profiles is not None:
        pre = sum(g["count"] * prefill_need(w, slo, p).per_worker for g, p in zip(groups, profiles))
        dec = sum(g["count"] * decode_need(w, slo, p, int(box.get("max_seqs") or 256)).per_worker
                  for g, p in zip(groups, profiles))
        src = {p.source for p in profiles}
        basis = (f"{'/'.join(sorted(src))} profile of {box['model_spec']} per GPU kind, at the "
                 "fleet's workload")
    else:
        peak = (plan.get("sizing") or {}).get("peak") or {}
        workers = sum(g["count"] for g in groups) or sum(
            plan["current"][ph]["workers"] for ph in ROLES)
        pre = workers * float((peak.get("prefill") or {}).get("per_worker") or 0.0)
        dec = workers * float((peak.get("decode") or {}).get("per_worker") or 0.0)
        basis = "this box's own plan (its per-worker figures at its own workload)"
    role = ((plan.get("cluster") or {}).get("role")) or "both"
    return BoxCapacity(url, name, shape, gpus, pre, dec, basis, role)


def appliance_name(url: str, plan: dict) -> str:
    return (plan.get("site") or {}).get("appliance") or url


def _profiles(box: dict, groups: list[dict]):
    """Profiles per worker group rebuilt from the catalogue, or None when they cannot be
    (the model is not a catalogue shape, or the box plans on a measured profile)."""
    from appliance.config import EngineConfig
    from appliance.models.specs import MODEL_SPECS
    from appliance.partitions.catalogue import lookup_gpu
    from appliance.planner.planner import BoxShape, profile_for
    spec = MODEL_SPECS.get(str(box.get("model_spec") or "").lower())
    if spec is None or not groups or box.get("profile_source") == "measured":
        return None
    engine = EngineConfig(max_seqs=int(box.get("max_seqs") or 256),
                          gpu_mem_fraction=float(box.get("gpu_mem_fraction") or 0.9))
    out = []
    for g in groups:
        try:
            gpu = None if g["device"] == "cpu" else lookup_gpu(g["device"])
        except ValueError:
            return None
        shape = BoxShape(spec, gpu, gpu, g["count"], 0, int(box.get("tp") or 1), 0,
                         True, kv_cache_bytes=int(box.get("kv_cache_bytes") or 0))
        out.append(profile_for(shape, gpu, None, engine))
    return out


def _fmt_head(h: float | None) -> str:
    return "-" if h is None else f"{h:.2f}x"


def explain(boxes: list[BoxCapacity], a: Assignment, need: FleetNeed) -> str:
    """Why, in numbers: each role's capacity against the need, and which binds."""
    if len(boxes) == 1:
        return ("one box: it keeps role both (its own plan splits its workers between the "
                "phases); roles need two boxes or more")
    if need.rate <= 0:
        return ("no traffic forecast: nothing to size; roles follow each box's prefill "
                "bias (FLOP/s per byte/s of its GPU kind)")
    p, d = a.headroom["prefill"], a.headroom["decode"]
    inf = lambda h: math.inf if h is None else h  # noqa: E731
    binds = "prefill" if inf(p) <= inf(d) else "decode"
    n_p = sum(r == "prefill" for r in a.roles.values())
    return (f"{n_p} prefill + {len(boxes) - n_p} decode: prefill {a.capacity['prefill']:.2f} "
            f"req/s at TTFT <= {need.slo['ttft_s']:g} s for {need.rate:.2f} req/s needed "
            f"({_fmt_head(p)}); decode {a.capacity['decode']:.0f} tok/s at ITL <= "
            f"{need.slo['itl_s'] * 1000:g} ms for {need.decode_tps:.0f} tok/s needed "
            f"({_fmt_head(d)}); {binds} binds")


def what_if_added(boxes: list[BoxCapacity], need: FleetNeed) -> list[dict]:
    """For each distinct box shape in the fleet: the plan with one more such box."""
    out, seen = [], set()
    for b in boxes:
        if b.shape in seen:
            continue
        seen.add(b.shape)
        extra = replace(b, url="(new)", name=f"new {b.shape}", role_now="both")
        a = assign(boxes + [extra], need)
        out.append({"shape": b.shape, "role": a.roles[extra.name],
                    "headroom": a.headroom, "fits": a.fits,
                    "roles": {n: r for n, r in a.roles.items() if n != extra.name}})
    return out


def config_snippets(boxes: list[BoxCapacity], a: Assignment) -> dict:
    """The `[cluster]` table for each box: a prefill box's peers are the decode boxes, a
    decode box's the prefill boxes; the key is the operator's to choose."""
    urls = {r: [b.url for b in boxes if a.roles[b.name] == r] for r in ROLES}
    out = {}
    for b in boxes:
        role = a.roles[b.name]
        if role == "both":
            out[b.name] = '[cluster]\nrole = "both"\n'
            continue
        peers = urls["decode" if role == "prefill" else "prefill"]
        out[b.name] = ('[cluster]\n'
                       f'role = "{role}"\n'
                       f'peers = [{", ".join(repr(u).replace(chr(39), chr(34)) for u in peers)}]\n'
                       'key = "<the same cluster key on every box, 16+ characters>"\n')
    return out


def plan_roles(results: list[tuple[str, dict]]) -> dict:
    """results: (url, plan) per answering appliance. The roles, their numbers, what one
    more box would change, and the config to apply."""
    plans = [p for _, p in results]
    need = fleet_need(plans)
    names = [appliance_name(url, plan) for url, plan in results]
    # Two boxes under one name (no [site] appliance on either, same hostname): by URL.
    boxes = [box_capacity(url, plan, need, name if names.count(name) == 1 else url)
             for (url, plan), name in zip(results, names)]
    a = assign(boxes, need)
    return {
        "roles": [{"appliance": b.name, "url": b.url, "shape": b.shape, "gpus": b.gpus,
                   "role": a.roles[b.name], "role_now": b.role_now,
                   "prefill_rps": round(b.prefill_rps, 4), "decode_tps": round(b.decode_tps, 2),
                   "basis": b.basis} for b in boxes],
        "need": {"rate": need.rate, "decode_tps": need.decode_tps, "workload": need.workload,
                 "slo": need.slo, "at": "each box's forecast peak (upper quantile), summed",
                 "horizon_s": max((p.get("horizon_s") or 0) for p in plans)},
        "capacity": a.capacity, "headroom": a.headroom, "fits": a.fits,
        "why": explain(boxes, a, need),
        "if_added": what_if_added(boxes, need) if len(boxes) >= 1 and need.rate > 0 else [],
        "config": config_snippets(boxes, a),
        "simulated": any(p.get("simulated") for p in plans),
        "source": "estimated from step-time profiles (simulated where the plans say so)",
    }
