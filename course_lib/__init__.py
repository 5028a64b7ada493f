"""course_lib: the compact library behind the notebooks and labs of *Parallel Training, Live*.

Start with :func:`launch`: it runs a function on N processes that form a ``torch.distributed`` group.
"""

from .launch import RankError, RankTimeout, WorkerGroup, device, launch

__all__ = ["launch", "device", "RankError", "RankTimeout", "WorkerGroup"]
