"""Where a job runs: the launch sequence as a library (``launcher``: ``prepare`` then ``execute``), its
local checks (``localcheck``) and job files (``jobfiles``), and the backends that start it: the SSH
fleet (``fleet`` over ``start``) and Slurm (``slurm/``).
"""
