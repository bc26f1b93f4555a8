"""Hostfile parsing and DeepSpeed's include/exclude semantics."""

from __future__ import annotations

import pytest

from orchestrator.errors import HostfileError
from orchestrator.spec.hostfile import HostEntry, Node, ResourceFilter, parse_hostfile, select_nodes

FOUR_NODES = "worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\nworker-3 slots=8\n"


def test_comments_blank_lines_and_tabs():
    text = "# cluster A\n\n\tworker-0\tslots=4   # the big one\nworker-1 slots=2\n   \n# end\n"
    assert parse_hostfile(text, "h.txt") == [
        HostEntry("worker-0", 4, 3),
        HostEntry("worker-1", 2, 4),
    ]


def _nodes(include="", exclude="", num_nodes=None, num_gpus=None, text=FOUR_NODES):
    entries = parse_hostfile(text, "h.txt")
    return [
        (n.host, list(n.slots))
        for n in select_nodes(entries, ResourceFilter(include, exclude, num_nodes, num_gpus), "h.txt")
    ]


# Each row: the flags, and what DeepSpeed's runner (parse_resource_filter, then
# --num_nodes) would pick. Order follows the hostfile, not the filter.
DEEPSPEED_CASES = [
    ({}, [("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 1, 2, 3]), ("worker-2", [0, 1]), ("worker-3", list(range(8)))]),
    ({"include": "worker-1"}, [("worker-1", [0, 1, 2, 3])]),
    ({"include": "worker-0@worker-1:0,2"}, [("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 2])]),
    ({"include": "worker-3:7,1,4"}, [("worker-3", [1, 4, 7])]),  # slot lists sorted
    ({"include": "worker-2@worker-0"}, [("worker-0", [0, 1, 2, 3]), ("worker-2", [0, 1])]),  # hostfile order
    ({"include": "worker-1:1,1,1"}, [("worker-1", [1])]),  # duplicates removed
    (
        {"exclude": "worker-1:0"},
        [("worker-0", [0, 1, 2, 3]), ("worker-1", [1, 2, 3]), ("worker-2", [0, 1]), ("worker-3", list(range(8)))],
    ),
    ({"exclude": "worker-0@worker-3"}, [("worker-1", [0, 1, 2, 3]), ("worker-2", [0, 1])]),
    (
        {"exclude": "worker-2:0,1"},  # all slots excluded: the host is dropped
        [("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 1, 2, 3]), ("worker-3", list(range(8)))],
    ),
    ({"num_nodes": 2}, [("worker-0", [0, 1, 2, 3]), ("worker-1", [0, 1, 2, 3])]),
    ({"include": "worker-1@worker-3", "num_nodes": 1}, [("worker-1", [0, 1, 2, 3])]),
    ({"exclude": "worker-0", "num_nodes": 2}, [("worker-1", [0, 1, 2, 3]), ("worker-2", [0, 1])]),
    ({"num_gpus": 2}, [("worker-0", [0, 1]), ("worker-1", [0, 1]), ("worker-2", [0, 1]), ("worker-3", [0, 1])]),
    ({"num_nodes": 1, "num_gpus": 1}, [("worker-0", [0])]),
    # Deviation from DeepSpeed, documented in hostfile.py: --num-gpus keeps the first
    # N slots the filter left (DeepSpeed would reset to range(N), re-adding slot 0).
    ({"exclude": "worker-0:0", "num_nodes": 1, "num_gpus": 2}, [("worker-0", [1, 2])]),
]


@pytest.mark.parametrize(("flags", "expected"), DEEPSPEED_CASES, ids=[str(c[0]) for c in DEEPSPEED_CASES])
def test_filters_follow_deepspeed(flags, expected):
    assert _nodes(**flags) == expected


FILTER_ERRORS = [
    ({"include": "worker-9"}, "host 'worker-9' is not in h.txt"),
    ({"include": "worker-2:2"}, "worker-2 has no slot 2"),
    ({"exclude": "worker-0:x"}, "slot 'x' of worker-0 is not a whole number"),
    ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
    ({"include": "worker-0@@worker-1"}, "empty entry"),
    ({"exclude": "worker-0@worker-1@worker-2@worker-3"}, "leave no hosts"),
    ({"num_nodes": 5}, "only 4 node(s)"),
    ({"num_nodes": 0}, "must be at least 1"),
    ({"num_gpus": 3}, "worker-2 has only 2 slot(s)"),
    ({"include": "worker-0:"}, "slot '' of worker-0"),
]


@pytest.mark.parametrize(("flags", "message"), FILTER_ERRORS, ids=[str(c[0]) for c in FILTER_ERRORS])
def test_bad_filters_are_refused(flags, message):
    with pytest.raises(HostfileError) as info:
        _nodes(**flags)
    assert message in info.value.message


def test_node_keeps_chosen_slots():
    entries = parse_hostfile("a slots=4\nb slots=4\n", "h")
    assert select_nodes(entries, ResourceFilter(include="b:3,1"), "h") == [Node("b", (1, 3))]
