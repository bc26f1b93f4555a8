"""What a person watching a job needs, gathered from the ranks' output (pure: no I/O).

The follow loop feeds every line a node prints (``feed``) and every poll of the
node states (``set_nodes``); the live view (``view.py``) and the plain lines
(``lines.py``) read the result. Lines fall into four kinds:

- ``dzctl-progress {...}``: the trainer's progress events (start, step,
  checkpoint, end, error), the same records as ``progress.jsonl``;
- noise a person never needs twice: the HF Trainer's own ``{'loss': ...}`` dict
  (the step event says it), tqdm bars, the source line under a Python warning, the
  failure counter a failed rank prints for ``status``;
- messages: anything else, kept once per distinct text with the nodes (and
  ranks, where the launcher prefixed them) it came from, and how often;
- nothing: blank lines.

A traceback counts as its last line only (``tracebacks.py``; torchrun's own, after a
rank failed, as nothing), and what a rank's ``error`` event says (its message, its
``error:``/``fix:`` lines) is kept once, as the failure: ``failure`` (view and lines
show it, with the rank's exit code and fix, see ``rankfailure.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .rankfailure import PROGRESS_PREFIX, error_details
from .status import FAILURE_SEQ_LINE
from .tracebacks import EXCEPTION, NOISE, RETRACT, TracebackFolder

# torchrun's per-rank prefix, when its --tee is on ("[rank3]:..." or "[default1]:...").
_RANK_PREFIX = re.compile(r"^\[(?:rank)?(\d+)\]:\s?")
_HF_LOG_DICT = re.compile(r"^\{'(loss|train_runtime|eval_loss|grad_norm)'")
_TQDM = re.compile(r"\d+%\|.*\||(it/s|s/it)\]")
_WARNING_SOURCE = re.compile(r"^\s+warnings\.warn\(")
_ERROR = re.compile(r"Traceback|Error\b|Exception\b|error:|FAILED|Killed|dzctl gang", re.IGNORECASE)
_WARNING = re.compile(r"Warning\b|warning:|\bWARN", re.IGNORECASE)
# "/site-packages/x/y.py:1541: FutureWarning: ..." -> "FutureWarning: ... (x/y.py:1541)": the same text from
# two installs (two venvs, two images) is one message.
_PY_WARNING = re.compile(r"^(?P<path>\S+\.py):(?P<line>\d+): (?P<text>\w*Warning: .*)$")


@dataclass
class Message:
    """One distinct line of rank output: where it came from and how often."""

    text: str
    level: str  # error | warning | info
    nodes: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)  # global ranks, when the launcher prefixed lines
    count: int = 0
    first_seen: float = 0.0
    # Arrival order among all messages: one read of a log brings many lines at one clock reading.
    order: int = 0


@dataclass
class NodeView:
    node_rank: int
    host: str
    slots: int
    state: str = "starting"
    exit_code: int | None = None
    last_output: float | None = None  # controller clock: when this node last printed anything
    gpu_mem_peak_gib: float | None = None


def classify(line: str) -> tuple[str, object]:
    """("progress", event) | ("noise", None) | ("message", (level, text, rank or None)) | ("blank", None)."""
    rank = None
    match = _RANK_PREFIX.match(line)
    if match:
        rank = int(match.group(1))
        line = line[match.end() :]
    stripped = line.strip()
    if not stripped:
        return "blank", None
    if stripped.startswith(PROGRESS_PREFIX):
        try:
            event = json.loads(stripped[len(PROGRESS_PREFIX) :])
        except json.JSONDecodeError:
            return "message", ("info", stripped, rank)
        if isinstance(event, dict) and "event" in event:
            return "progress", event
    if (
        _HF_LOG_DICT.match(stripped)
        or _TQDM.search(stripped)
        or _WARNING_SOURCE.match(line)
        or stripped.startswith(FAILURE_SEQ_LINE)  # for status's ordering of failures, not for a person
    ):
        return "noise", None
    python_warning = _PY_WARNING.match(stripped)
    if python_warning:
        where = "/".join(python_warning["path"].split("/")[-2:])
        return "message", ("warning", f"{python_warning['text']} ({where}:{python_warning['line']})", rank)
    level = "error" if _ERROR.search(stripped) else "warning" if _WARNING.search(stripped) else "info"
    return "message", (level, stripped, rank)


@dataclass
class JobWatch:
    """Everything the view shows, updated by ``feed`` and ``set_nodes``."""

    job: str
    job_id: str
    nodes: list[NodeView]
    started_at: float  # controller clock
    accelerator: str = "gpu"
    state: str = "starting"
    speed: dict | None = None  # the plan's predicted step (the record's plan["speed"]), when it was predicted
    events: list[dict] = field(default_factory=list)
    messages: dict[str, Message] = field(default_factory=dict)
    first_failure: dict | None = None
    ended_at: float | None = None
    errors: list[dict] = field(default_factory=list)  # the ranks' error events, as rankfailure.error_details
    # The latest poll's stall verdict (evidence.stall_of: the bound that applied, the culprit once stalled).
    stall: dict | None = None
    # Lines that say what an error event already says (the rank's "error:"/"fix:" lines, the last
    # line of its traceback): shown once, through the event.
    _said: set[str] = field(default_factory=set)
    _tracebacks: TracebackFolder = field(default_factory=TracebackFolder)
    _arrivals: int = 0  # messages seen so far, for Message.order
    _stalls_said: set[tuple] = field(default_factory=set)  # (phase, step) of each stall already reported

    @property
    def steps(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "step"]

    @property
    def evals(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "eval"]

    @property
    def checkpoints(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "checkpoint"]

    @property
    def world_size(self) -> int:
        for event in self.events:
            if event.get("event") == "start" and isinstance(event.get("world_size"), int):
                return event["world_size"]
        return sum(n.slots for n in self.nodes) or 1

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("event") == kind), None)

    def feed(self, node_rank: int, line: str, now: float) -> tuple[str, object] | None:
        """One line of a node's output; returns what is new for a reader of plain lines, or None.

        New: ("event", event) for a progress event, ("message", Message) the first
        time a distinct message is seen. Repeats and noise return None.
        """
        node = self.nodes[node_rank] if 0 <= node_rank < len(self.nodes) else None
        if node is not None:
            node.last_output = now
        folded, exception = self._tracebacks.take(node_rank, line)
        if folded == RETRACT:
            # The line was a chained exception's cause: the exception raised last is what it says.
            cause = self.messages.get(exception or "")
            if cause is not None and cause.count == 1:
                del self.messages[cause.text]
            return None
        if folded == NOISE:
            return None
        if folded == EXCEPTION:
            prefix = _RANK_PREFIX.match(line)
            kind, payload = "message", ("error", exception, int(prefix.group(1)) if prefix else None)
        else:
            kind, payload = classify(line)
        if kind == "progress":
            event = payload  # type: ignore[assignment]
            self.events.append(event)
            self._note_memory(event)
            if event.get("event") == "error":
                self._note_error(event)
            return "event", event
        if kind != "message":
            return None
        level, text, rank = payload  # type: ignore[misc]
        if text in self._said:
            return None
        message = self.messages.get(text)
        is_new = message is None
        if message is None:
            self._arrivals += 1
            message = self.messages[text] = Message(text, level, first_seen=now, order=self._arrivals)
        message.count += 1
        message.nodes.add(node_rank)
        if rank is not None:
            message.ranks.add(rank)
        return ("message", message) if is_new else None

    def _note_error(self, event: dict) -> None:
        error = error_details(event)
        self.errors.append(error)
        message = error.get("message") or error["reason"]
        said = {error["reason"], message, f"error: {message}"}
        if error.get("fix"):
            said.add(f"fix: {error['fix']}")
        self._said |= said
        for text in said:  # printed before the event reached us (two streams of one container)
            self.messages.pop(text, None)

    @property
    def failure(self) -> dict | None:
        """The first failure once status decided it; until then the first error event a rank wrote."""
        if self.first_failure is not None or not self.errors:
            return self.first_failure
        error = self.errors[0]
        rank = error.get("rank")
        node = self._node_of_rank(rank) if isinstance(rank, int) else None
        return {
            "node_rank": node.node_rank if node else "?",
            "host": node.host if node else "?",
            "rank": rank,
            "exit_code": error.get("exit_code"),
            "reason": error["reason"],
            "message": error.get("message") or error["reason"],
            "fix": error.get("fix"),
        }

    def _node_of_rank(self, rank: int) -> NodeView | None:
        first = 0
        for node in self.nodes:
            if first <= rank < first + node.slots:
                return node
            first += node.slots
        return None

    def _note_memory(self, event: dict) -> None:
        # Step events carry rank 0's peak; the end event every rank's [allocated, reserved].
        peak = event.get("gpu_mem_peak_gib")
        if isinstance(peak, (int, float)) and self.nodes:
            node = self.nodes[0]
            node.gpu_mem_peak_gib = max(node.gpu_mem_peak_gib or 0.0, float(peak))
        per_rank = event.get("gpu_mem_peak_gib_per_rank")
        if isinstance(per_rank, list):
            first = 0
            for node in self.nodes:
                mine = [p[0] for p in per_rank[first : first + node.slots] if isinstance(p, list) and p]
                if mine:
                    node.gpu_mem_peak_gib = max(mine)
                first += node.slots

    def set_nodes(self, states: dict[int, tuple[str, int | None]], job_state: str) -> None:
        """The latest poll: node rank -> (state, exit code), and the job's derived state."""
        for node in self.nodes:
            if node.node_rank in states:
                node.state, node.exit_code = states[node.node_rank]
        self.state = job_state

    def set_stall(self, stall: dict | None) -> dict | None:
        """The latest poll's stall verdict, after ``set_nodes``; returns it when it is a stall not reported yet.

        A running job that is stalled reads ``stalled``, as ``status`` says it. One stall (its phase
        and step) is new once: a plain-lines reader says it once, not at every poll.
        """
        self.stall = stall
        if not stall or not stall.get("stalled"):
            return None
        if self.state == "running":
            self.state = "stalled"
        key = (stall.get("phase"), stall.get("step"))
        if key in self._stalls_said:
            return None
        self._stalls_said.add(key)
        return stall


def ema(values: list[float], factor: float) -> list[float]:
    """Exponential moving average, ``s = factor * s + (1 - factor) * x``, bias-corrected.

    The correction (as in Adam and TensorBoard's smoothing) divides by
    ``1 - factor**n``, so the first points are not dragged towards zero.
    """
    smoothed, running = [], 0.0
    for n, value in enumerate(values, start=1):
        running = factor * running + (1 - factor) * value
        smoothed.append(running / (1 - factor**n))
    return smoothed


SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def _buckets(values: list[float], width: int) -> list[float]:
    """At most ``width`` points: means of equal slices over the whole history, so a chart shows the run's shape."""
    if len(values) <= width:
        return values
    size = len(values) / width
    return [
        sum(chunk) / len(chunk)
        for chunk in (values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)] for i in range(width))
    ]


def sparkline(values: list[float], width: int = 40) -> str:
    """The last ``width`` values (averaged into buckets when there are more) as block characters."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    values = _buckets(values, width)
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK_BLOCKS[min(len(SPARK_BLOCKS) - 1, int((v - low) / span * len(SPARK_BLOCKS)))] for v in values)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def ranks_text(message: Message) -> str:
    """Where a message came from: its ranks when known, else its nodes, and how many times."""
    where = f"rank {_ranges(sorted(message.ranks))}" if message.ranks else f"node {_ranges(sorted(message.nodes))}"
    return where + (f" ×{message.count}" if message.count > 1 else "")


def _ranges(numbers: list[int]) -> str:
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def block_chart(values: list[float], width: int = 60, height: int = 8) -> list[str]:
    """A small terminal chart: ``height`` rows of block characters, min and max on the left."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return []
    values = _buckets(values, width)
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    # Each column's height in eighths of a row.
    eighths = [round((v - low) / span * (height * 8 - 1)) + 1 for v in values]
    rows = []
    for row in range(height - 1, -1, -1):
        cells = []
        for level in eighths:
            filled = level - row * 8
            cells.append("█" if filled >= 8 else " " if filled <= 0 else SPARK_BLOCKS[filled - 1])
        label = f"{high:9.4g} ┤" if row == height - 1 else f"{low:9.4g} ┤" if row == 0 else " " * 9 + " │"
        rows.append(label + "".join(cells))
    return rows
