"""Test-only stand-in for the ``horovod`` package: ``horovod.torch`` is ``mpidp.horovod``."""
