"""Where a job runs: the launch sequence as a library (``launcher``: ``prepare`` then ``execute``), the
job files made from the resolved job (``jobfiles``), and the backends that start it: the SSH fleet
(``fleet`` over ``start``) and Slurm (``slurm/``).
"""
