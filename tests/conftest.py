"""Shared test setup. Its presence puts tests/ on sys.path, so test modules in
subfolders can `import helpers`.

- Tests run torch on one thread (subprocesses inherit it): the test models are
  tiny, and on a busy 2-core machine two OpenMP threads per process spin against
  each other and run ten times slower.
- Everything llmrun writes (model cache, REPL history, built kernels) goes to a
  temporary LLMRUN_HOME for the session, never to the user's own folders.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "LLMRUN_HOME" not in os.environ:
    _home = tempfile.mkdtemp(prefix="llmrun-tests-")
    os.environ["LLMRUN_HOME"] = _home
    atexit.register(shutil.rmtree, _home, ignore_errors=True)
