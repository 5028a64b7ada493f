"""course_lib: the compact library behind the notebooks and labs of *Parallel Training, Live*.

Start with :func:`launch`: it runs a function on N processes that form a ``torch.distributed`` group.
"""

from .runtime.launch import RankError, RankTimeout, WorkerGroup, device, launch
from .runtime.world import World

__all__ = ["launch", "device", "RankError", "RankTimeout", "WorkerGroup", "World"]


def load_ipython_extension(ipython):
    """``%load_ext course_lib`` adds the ``%ranks`` / ``%%ranks`` magics (see course_lib/runtime/magics.py)."""
    from .runtime.magics import load_ipython_extension as add_magics

    add_magics(ipython)


def unload_ipython_extension(ipython):
    magics = ipython.magics_manager.registry.get("RanksMagics")
    if magics is not None and magics.world is not None:
        magics.world.stop()
        magics.world = None
