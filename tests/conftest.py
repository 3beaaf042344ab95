"""The quick tier: ``pytest -m quick`` runs these files and the 2-rank launch of the check files.

Files that start no MPI job are quick (but for the docs' snippet runs, which do);
tests/test_mpi.py marks its own quick test (every check file at 2 ranks, in one launch).
"""

import pytest

QUICK_FILES = {"test_units.py", "test_docs.py", "test_layers.py", "test_topology.py",
               "test_sampler.py", "test_overlap.py", "test_kernels.py", "test_cuda.py",
               "test_doctor.py"}
LAUNCHING = {"test_complete_snippets_run",
             "test_doctor_names_each_seeded_misconfiguration"}  # in those files, but each starts an mpiexec job


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK_FILES and item.originalname not in LAUNCHING:
            item.add_marker(pytest.mark.quick)
