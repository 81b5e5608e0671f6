"""Shared test setup. Its presence puts tests/ on sys.path, so test modules in
subfolders can `import helpers`."""
