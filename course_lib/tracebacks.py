"""A rank's traceback, as a learner wants to read it: the lines of their own notebook cell, short file names,
and none of the machinery's frames.

Code defined in a notebook cell travels to the ranks by value (cloudpickle), keeping its file name, and the
cell's source lines travel with it (IPython keeps them only in the kernel's ``linecache``), so a rank's
traceback shows ``Cell In[3], line 2`` and the line itself.
"""

from __future__ import annotations

import collections
import io
import linecache
import os
import re
import types

import cloudpickle


class CodePickler(cloudpickle.Pickler):
    """cloudpickle, except that code keeps its file name (cloudpickle writes '<dynamic-code>'), so a
    rank's traceback can show the lines of the notebook cell or script the code came from."""

    dispatch_table = collections.ChainMap({types.CodeType: lambda code: _keep_filename(code)},
                                          cloudpickle.Pickler.dispatch_table)



def _keep_filename(code):
    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return make, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)



def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    CodePickler(buffer).dump(obj)
    return buffer.getvalue()



def user_frames(stack: str) -> str:
    """A faulthandler dump, cut where the learner's code was called from this module."""
    lines = stack.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if any(f'"{path}"' in line for path in PLUMBING_FILES):
            return "".join(lines[:i])
    return stack



def name_cells(text: str) -> str:
    """Shorter file names in a rank's traceback: 'Cell In[3]' (as IPython writes it) for the kernel's temporary
    file of a notebook cell, '.../site-packages/torch/...' for installed packages, 'course_lib/...' for ours."""
    text = re.sub(r'File "[^"]*/site-packages/', 'File ".../site-packages/', text)
    text = text.replace(f'File "{os.path.dirname(os.path.dirname(__file__))}/', 'File "')  # course_lib/...
    try:
        from IPython import get_ipython
        compiler = get_ipython().compile
    except (ImportError, AttributeError):
        return text
    for filename in set(re.findall(r'File "([^"]+)"', text)):
        cell = compiler.format_code_name(filename) if hasattr(compiler, "format_code_name") else None
        if cell:
            text = text.replace(f'File "{filename}"', " ".join(cell))
    return text



def interactive_sources() -> dict:
    """Source lines of code typed into notebook cells (IPython keeps them in ``linecache`` only)."""
    return {name: entry for name, entry in linecache.cache.items()
            if len(entry) == 4 and entry[1] is None and not os.path.exists(name)}



PLUMBING_FILES: set[str] = set()  # modules whose frames a learner need not see (workers, world add themselves)



def skip_plumbing_frames(tb):
    """Start the traceback at the learner's code, not at the worker loop that called it."""
    while tb is not None and tb.tb_frame.f_code.co_filename in PLUMBING_FILES and tb.tb_next is not None:
        tb = tb.tb_next
    return tb
