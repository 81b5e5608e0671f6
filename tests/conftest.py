"""Shared test setup. Its presence puts tests/ on sys.path, so test modules in
subfolders can `import helpers`.

Tests run torch on one thread (subprocesses inherit it): the test models are
tiny, and on a busy 2-core machine two OpenMP threads per process spin against
each other and run ten times slower.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
