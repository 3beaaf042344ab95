"""``in_thread``, which Horovod's test utilities import (``test/utils/common.py``)."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Run ``target(*args)`` in a new thread, started before returning it.

    Args:
        silent: accepted for Horovod's signature (its threads could swallow errors);
            here an exception is reported by ``threading.excepthook`` as usual.
    """
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
