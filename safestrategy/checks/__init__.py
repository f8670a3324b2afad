"""How a candidate is run, judged and timed: in this process or in a probe process.

``runner`` decides where each candidate runs; ``allreduce`` is the all-reduce a
check runs and how its numbers are judged; ``timing`` how fast it ran and what
is kept of it; ``nccl`` NCCL's verdict and its one remedy loop; ``stalls``
what a record of trouble during training means for the next decision;
``probe`` and ``child`` the two sides of the probe process.
"""
