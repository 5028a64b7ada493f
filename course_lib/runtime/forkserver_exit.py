"""Imported by multiprocessing's forkserver only (``workers._context`` preloads it; nothing else imports it).

The forkserver stops when every process that holds its "alive" pipe is gone: the notebook and its ranks. It
then leaves by ``SystemExit``, and the interpreter tears torch down, which took tens of seconds on a busy 2-core
machine: long after the kernel was killed, a process of it still ran. There is nothing to clean up (the
notebook's side owns the socket file), so it ends at once. The ranks it forks never run this: a forked child
of the forkserver always ends with ``os._exit``.
"""

import atexit
import os

atexit.register(os._exit, 0)
