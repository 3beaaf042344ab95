"""``import horovod.torch as hvd`` gives ``mpidp.horovod`` itself (tests only).

The module replaces its own entry in ``sys.modules``; the import statement returns
that entry, so ``hvd`` is ``mpidp.horovod`` with every name it has.
"""

import sys

import mpidp.horovod

sys.modules[__name__] = mpidp.horovod
