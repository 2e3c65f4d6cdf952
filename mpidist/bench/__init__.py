"""``python -m mpidist.bench`` (``mpidist-bench``): mpidist against raw mpi4py, reported as nccl-tests does.

Not imported by ``import mpidist``; the command is in ``__main__.py``, the cases
(what each ``-c`` choice sets up and calls) in ``cases.py``, where the buffers live
in ``devices.py``, the timing and the table, JSON and plot in ``timing.py``.
"""
