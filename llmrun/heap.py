"""glibc malloc's limits, as the command line sets them (llmrun.cli.process) and as
buffers are sized to stay within them (generate's prompt chunks).

Light on purpose: the command line reads it before torch is imported.
"""

# The largest block glibc's malloc gives from its heap (its most): a larger one is mapped
# anew at each allocation and its pages faulted in again.
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top kept up to this size, not handed back (glibc's default:
# twice the mmap threshold, which glibc moves with the sizes it sees freed).
TRIM_THRESHOLD = 256 << 20
