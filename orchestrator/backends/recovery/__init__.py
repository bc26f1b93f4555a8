"""Unattended recovery (issue 31): the restart policy, the supervisor, spare hosts, notifications.

- ``policy``: a failed job's cause, and whether a restart can fix it (pure);
- ``spares``: which spare host takes a failed node's place, keeping the world size (pure);
- ``record``: the supervision record beside the job records (restarts, causes, nodes replaced);
- ``notify``: the webhook POST (bounded; a failing receiver never fails the job);
- ``supervisor``: the detached process that watches a job and relaunches it.
"""
