"""The collective check's verdict, from what each node printed (pure: no hosts, no clock).

``NodeWatch`` takes one node's output lines as they arrive and keeps the last step each
of its ranks reached; ``judge`` turns every node's watch into one ``collective`` check per
host plus the figures for ``--json`` and the job record.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .model import Check, fail, ok, warn
from .nccl_lines import PATH_NAMES, Transports, parse_progress_all, store_failure

RUNBOOKS = "docs/runbooks"
RUNBOOK_FORM = f"{RUNBOOKS}/nccl-group-did-not-form.md"
RUNBOOK_IB = f"{RUNBOOKS}/nccl-ib-unused.md"
RUNBOOK_SLOW = f"{RUNBOOKS}/nccl-slow-collective.md"

STEPS = ("start", "imported", "store", "group", "iter", "result")
STEP_WORDS = {
    "start": "started, still importing torch",
    "imported": "imported torch, never reached the master's store",
    "store": "connected to the master's store, never joined the group",
    "group": "joined the group, never finished the all-reduce",
    "iter": "joined the group, never finished the all-reduce",
    "result": "finished",
}

# The least bus bandwidth (GB/s) each transport should give an all-reduce of >= 64 MiB, below
# which the check warns. Half of what a healthy link of the slowest common kind reaches:
# - P2P over NVLink: 302 GB/s measured between the two H200s (NV18) here, 256 MiB, bf16
#   (docs/../DESIGN figures; nccl-tests on DGX H100 report ~450 GB/s over 8 GPUs);
# - P2P over PCIe: PCIe 4.0 x16 carries ~25 GB/s per direction in practice;
# - SHM: through host memory, a few GB/s;
# - NET/IB: HDR InfiniBand, 200 Gb/s = 25 GB/s per NIC (NDR doubles it);
# - NET/Socket: 10 GbE is 1.25 GB/s on the wire.
# The link rates are outside figures (InfiniBand Trade Association, PCI-SIG), not measured here.
EXPECTED_MIN_BUSBW_GBS = {
    "P2P/NVLink": 150.0,
    "P2P/PCIe": 10.0,
    "SHM": 2.0,
    "NET/IB": 10.0,
    "NET/Socket": 0.5,
}
MIN_BYTES_FOR_EXPECTATIONS = 64 * 2**20  # below this, latency, not the link, sets the figure


@dataclass
class NodeWatch:
    """One node's ranks as seen through its output."""

    host: str
    node_rank: int
    slots: int
    first_rank: int  # the global rank of its local rank 0 (torchrun numbers nodes in order)
    launcher_started: bool = False
    start_error: str | None = None
    ended: bool = False
    last: dict[int, dict] = field(default_factory=dict)  # rank -> its last progress record
    results: dict[int, dict] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    group_records: list[dict] = field(default_factory=list)  # each rank's "group" record (form_s)
    transports: Transports = field(default_factory=Transports)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=12))
    store_failure_line: str | None = None
    # Set when the controller starts removing the check: what the node prints or does after that
    # (the launcher ending because it was killed) is the cleanup's doing, not the node's.
    closed: bool = False

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.slots)

    def feed(self, line: str) -> None:
        if self.closed:
            return
        records = parse_progress_all(line)
        for record in records:
            rank = int(record["rank"])
            self.last[rank] = record
            if record["event"] == "result":
                self.results[rank] = record
            elif record["event"] == "group":
                self.group_records.append(record)
            elif record["event"] == "error":
                self.errors[rank] = str(record.get("error", ""))
        if records:
            return
        if self.transports.feed(line):
            return
        text = line.strip()
        if not text:
            return
        if store_failure(text) and self.store_failure_line is None:
            self.store_failure_line = text[-300:]
        self.tail.append(text[-300:])

    def reached(self, rank: int) -> str | None:
        record = self.last.get(rank)
        return record["event"] if record else None

    def joined(self) -> bool:
        return all(self.reached(r) in ("group", "iter", "result") for r in self.ranks)

    def done(self) -> bool:
        return all(r in self.results for r in self.ranks)

    def step(self) -> str:
        """The last step the node reached, in words, for a failure message."""
        if self.start_error:
            return f"its launcher did not start: {self.start_error}"
        if not self.launcher_started:
            return "not started"
        if self.errors:
            rank, error = min(self.errors.items())
            return f"rank {rank} failed: {error}"
        reached = [self.reached(r) for r in self.ranks]
        if all(step is None for step in reached):
            why = f" ({self.store_failure_line})" if self.store_failure_line else ""
            ended = "; the launcher exited" if self.ended else ""
            return (
                f"launcher running, no rank started: it did not complete the launcher's rendezvous at the "
                f"master's store{why}{ended}"
            )
        lowest = min(reached, key=lambda step: -1 if step is None else STEPS.index(step))
        waiting = [r for r, step in zip(self.ranks, reached, strict=True) if step == lowest]
        words = STEP_WORDS.get(lowest or "start", "not started") if lowest else "never started"
        return f"rank {', '.join(map(str, waiting))}: {words}" + ("; the launcher exited" if self.ended else "")


@dataclass
class Settings:
    timeout_s: float
    size_bytes: int
    iters: int
    warmup: int
    gather_bytes: int | None = None  # None: size_bytes
    reduce_bytes: int | None = None


@dataclass
class CollectiveOutcome:
    """What the check found: a check per host and the figures."""

    checks: dict[str, Check]
    figures: dict

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks.values())


def transport_key(transports: Transports, multi_node: bool) -> str | None:
    """The transport the bandwidth is held to: the slowest kind the all-reduce crossed."""
    if multi_node and transports.between:
        return "NET/Socket" if "NET/Socket" in transports.between else "NET/IB"
    if any(t.startswith("P2P") for t in transports.within):
        return "P2P/NVLink" if transports.intra_path in ("NVL", "NVB", "C2C") else "P2P/PCIe"
    if "SHM" in transports.within:
        return "SHM"
    return None


def judge(
    watches: list[NodeWatch],
    settings: Settings,
    *,
    formed_in_time: bool,
    elapsed_s: float,
    launch_to_group_s: float | None,
    infiniband_hosts: frozenset[str],
    backend_hint: str,
) -> CollectiveOutcome:
    world = sum(w.slots for w in watches)
    multi_node = len(watches) > 1
    figures: dict = {
        "ran": True,
        "ok": False,
        "backend": backend_hint,
        "world_size": world,
        "nodes_count": len(watches),
        "bytes": settings.size_bytes,
        "iters": settings.iters,
        "warmup": settings.warmup,
        "timeout_s": settings.timeout_s,
        "elapsed_s": round(elapsed_s, 3),
        "launch_to_group_s": None if launch_to_group_s is None else round(launch_to_group_s, 3),
    }
    group = Transports()
    for watch in watches:
        group.merge(watch.transports)
    figures["transports"] = group.to_dict()
    figures["nodes"] = [_node_figures(w) for w in watches]
    form_times = [r["form_s"] for w in watches for r in w.group_records if "form_s" in r]
    figures["form_s"] = round(max(form_times), 3) if form_times else None

    missing = never_joined(watches)
    failed_ranks = [w for w in watches if w.errors or w.start_error]
    checks: dict[str, Check] = {}
    if missing or failed_ranks:
        return _not_formed(watches, missing, failed_ranks, settings, formed_in_time, figures)

    unfinished = [w for w in watches if not w.done()]
    if unfinished:
        for watch in watches:
            detail = "the group formed but the all-reduce did not finish within the check's time: " + "; ".join(
                f"node {w.node_rank} ({w.host}): {w.step()}" for w in unfinished
            )
            checks[watch.host] = fail("collective", detail, f"see {RUNBOOK_FORM}")
        figures["failure"] = "all-reduce did not finish"
        return CollectiveOutcome(checks, figures)

    result = next(r for w in watches for r in w.results.values())
    figures.update(
        backend=result.get("backend", backend_hint),
        dtype=result.get("dtype"),
        bytes=result.get("bytes", settings.size_bytes),
        mean_s=result.get("group_mean_s"),
        algbw_gbs=result.get("group_algbw_gbs"),
        busbw_gbs=result.get("group_busbw_gbs"),
    )
    figures["zero3"] = zero3_figures(result, multi_node)
    size_mib = figures["bytes"] / 2**20
    base = (
        f"all-reduce {size_mib:g} MiB × {settings.iters} over {world} rank(s): busbw {figures['busbw_gbs']} GB/s, "
        f"algbw {figures['algbw_gbs']} GB/s; {_formed(figures)}"
    )
    gpu = figures["backend"] == "nccl"
    for watch in watches:
        node = next(n for n in figures["nodes"] if n["host"] == watch.host)
        said = watch.transports.describe()
        detail = f"{base}; node busbw {node['busbw_gbs']} GB/s" + (f"; {said}" if said else "")
        check = ok("collective", detail)
        if (
            gpu
            and multi_node
            and watch.host in infiniband_hosts
            and "NET/Socket"
            in (
                watch.transports.between or ({f"NET/{watch.transports.network}"} if watch.transports.network else set())
            )
        ):
            check = fail(
                "collective",
                f"{detail}: this node has InfiniBand devices but NCCL used TCP sockets between nodes "
                "(4-5× less bandwidth)",
                f"pass the IB devices and libraries into the container, then rerun; see {RUNBOOK_IB}",
            )
        elif gpu and figures["bytes"] >= MIN_BYTES_FOR_EXPECTATIONS:
            key = transport_key(watch.transports, multi_node)
            floor = EXPECTED_MIN_BUSBW_GBS.get(key) if key else None
            measured = node["busbw_gbs"]
            if floor is not None and measured is not None and measured < floor:
                check = warn(
                    "collective",
                    f"{detail}: below the {floor:g} GB/s {key} should give at least",
                    f"check the links (nvidia-smi topo -m, ibstat) and NCCL's choices; see {RUNBOOK_SLOW}",
                )
        checks[watch.host] = check
    figures["ok"] = all(c.status != "fail" for c in checks.values())
    return CollectiveOutcome(checks, figures)


ZERO3_COLLECTIVES = ("all_gather", "reduce_scatter")


def zero3_figures(result: dict, multi_node: bool) -> dict | None:
    """ZeRO-3's collectives as the check measured them (the group's slowest rank), and which link they bound.

    Which link: the check has one group over every rank and no per-link timing. On several
    nodes a ring collective moves at the pace of its slowest edge, a node's network link
    (NVLink/PCIe within a node is many times faster), so the figures are the inter-node bound;
    on one node there is no network in the ring and they are the intra-node figures.
    ``None``: a node that ran an older check module printed no such fields.
    """
    if result.get("all_gather_group_busbw_gbs") is None:
        return None
    out: dict = {"scope": "inter" if multi_node else "intra"}
    for name in ZERO3_COLLECTIVES:
        out[name] = {
            "bytes": result.get(f"{name}_bytes"),
            "mean_s": result.get(f"{name}_group_mean_s"),
            "busbw_gbs": result.get(f"{name}_group_busbw_gbs"),
            "latency_s": result.get(f"{name}_latency_s"),
        }
    out["all_reduce_latency_s"] = result.get("all_reduce_latency_s")
    return out


def describe_zero3(zero3: dict | None) -> str | None:
    """``all-gather 0.41 GB/s (latency 327 µs), reduce-scatter ...``, or None when not measured."""
    if not zero3:
        return None
    measured = [(name, zero3.get(name) or {}) for name in ZERO3_COLLECTIVES]
    parts = [
        f"{name.replace('_', '-')} {one['busbw_gbs']} GB/s busbw (latency {one['latency_s'] * 1e6:.0f} µs)"
        for name, one in measured
        if one.get("busbw_gbs") is not None and one.get("latency_s") is not None
    ]
    where = "between nodes" if zero3.get("scope") == "inter" else "within the node"
    return f"{', '.join(parts)} {where}" if parts else None


def never_joined(watches: list[NodeWatch]) -> list[NodeWatch]:
    """The nodes to blame for a group that did not form.

    Once any rank started: of the nodes with a rank outside the group, those furthest behind
    (two nodes blocked from each other after the rendezvous are both named: nothing tells them
    apart). Before any rank started anywhere, node 0 hosts the launchers' store and only the
    others can fail to reach it: those that said so, or else all of them. Plus any node whose
    launcher exited.
    """
    not_joined = [w for w in watches if not w.joined()]
    if any(w.last for w in watches):
        # The furthest behind: a node whose ranks never started (its launcher never reached the
        # store) before one whose ranks wait in the group's init for it.
        lowest = min((_lowest_step(w) for w in not_joined), default=0)
        blamed = [w for w in not_joined if _lowest_step(w) == lowest]
    else:
        workers = [w for w in not_joined if w.node_rank != 0]
        said_so = [w for w in workers if w.store_failure_line]
        blamed = said_so or workers or not_joined
    # A launcher that exited (node 0's too) failed on its own node.
    exited = [w for w in not_joined if w.ended and w not in blamed]
    return sorted(blamed + exited, key=lambda w: w.node_rank)


def _lowest_step(watch: NodeWatch) -> int:
    # "error" and anything unknown count as not started: a failed rank is as far behind as it gets.
    return min(STEPS.index(step) if (step := watch.reached(r)) in STEPS else -1 for r in watch.ranks)


def _node_figures(watch: NodeWatch) -> dict:
    results = [watch.results[r] for r in watch.ranks if r in watch.results]
    # The node's slowest rank stands for the node.
    slowest = max(results, key=lambda r: r.get("mean_s", 0.0)) if results else None
    return {
        "host": watch.host,
        "node_rank": watch.node_rank,
        "ranks": list(watch.ranks),
        "reached": {str(r): watch.reached(r) for r in watch.ranks},
        "busbw_gbs": slowest.get("busbw_gbs") if slowest else None,
        "algbw_gbs": slowest.get("algbw_gbs") if slowest else None,
        "mean_s": slowest.get("mean_s") if slowest else None,
        "transports": watch.transports.to_dict(),
        "intra_node_path_name": PATH_NAMES.get(watch.transports.intra_path or "", None),
    }


def _not_formed(
    watches: list[NodeWatch],
    missing: list[NodeWatch],
    failed: list[NodeWatch],
    settings: Settings,
    formed_in_time: bool,
    figures: dict,
) -> CollectiveOutcome:
    never = sorted({r for w in missing for r in w.ranks if w.reached(r) not in ("group", "iter", "result")})
    names = ", ".join(f"node {w.node_rank} ({w.host})" for w in missing)
    if failed:
        headline = "the collective failed: " + "; ".join(f"node {w.node_rank} ({w.host}): {w.step()}" for w in failed)
    elif formed_in_time or any(w.ended for w in missing):
        headline = f"the group did not form: {names} never joined"
    else:
        headline = f"the group did not form within {settings.timeout_s:g} s: {names} never joined"
    if never:
        headline += f"; never heard from rank {', '.join(map(str, never))}"
    figures["failure"] = headline
    figures["never_joined"] = [w.host for w in missing]
    fix = (
        "open the master port and NCCL/gloo's ports between the nodes (firewalls, security groups), check that "
        f"NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME name a NIC that reaches the other nodes; see {RUNBOOK_FORM}"
    )
    if any("No module named 'orchestrator" in line for w in watches for line in w.tail):
        fix = "the image or Python lacks dzctl's check module: rebuild the image with dzctl build (or update dzctl "
        fix += "in launch.python's environment) and distribute it again; then " + fix
    checks = {}
    for watch in watches:
        if watch in missing or watch in failed:
            extra = f"; last output: {watch.tail[-1]}" if watch.tail else ""
            checks[watch.host] = fail("collective", f"{headline}; here: {watch.step()}{extra}", fix)
        elif not watch.last and watch.node_rank == 0:
            checks[watch.host] = fail(
                "collective", f"{headline}; this node hosts the master's store and waited for the others", fix
            )
        else:
            checks[watch.host] = fail("collective", f"{headline}; this node joined", fix)
    return CollectiveOutcome(checks, figures)


def describe_collective(figures: dict) -> str:
    """One line for people: what the check measured, or why it did not run or failed."""
    if not figures.get("ran"):
        return f"collective check: {figures.get('reason') or 'not run'}"
    if figures.get("failure"):
        return f"collective check FAILED: {figures['failure']}"
    transports = figures.get("transports") or {}
    seen = [
        *(f"{t} within nodes" for t in transports.get("within_node") or []),
        *(f"{t} between nodes" for t in transports.get("between_nodes") or []),
    ]
    path = transports.get("intra_node_path")
    via = f" ({', '.join(seen)}{'; path ' + PATH_NAMES.get(path, path) if path else ''})" if seen else ""
    return (
        f"collective check: all-reduce {figures['bytes'] / 2**20:g} MiB × {figures['iters']} over "
        f"{figures['world_size']} rank(s), {figures.get('backend')}: busbw {figures.get('busbw_gbs')} GB/s, "
        f"algbw {figures.get('algbw_gbs')} GB/s{via}; {_formed(figures)}, check took {figures.get('elapsed_s')} s"
        + (f"; {zero3}" if (zero3 := describe_zero3(figures.get("zero3"))) else "")
    )


def _formed(figures: dict) -> str:
    # From the launchers' start (their Python and torch imports, the rendezvous) and, within
    # that, the process group's own initialisation (store to first collective).
    started = figures.get("launch_to_group_s")
    lead = f"group formed {started} s after the launchers started" if started is not None else "group formed"
    return f"{lead} (init {figures.get('form_s')} s)"
