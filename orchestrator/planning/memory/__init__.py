"""The memory planner: ``estimate`` (the model of a ZeRO-3 job's memory), ``search`` (the choice),
``refusal`` (a job that does not fit, and the ways out), ``fromjob`` (the planner's inputs from a spec).
"""
