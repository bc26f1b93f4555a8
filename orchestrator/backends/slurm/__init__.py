"""The Slurm backend: the same plan submitted with sbatch, one launcher per allocated node through srun.

``script`` writes the batch script (pure); ``backend`` submits it and reads the
job back (squeue, scontrol, sacct, the ranks' records in the shared job dir).
"""
