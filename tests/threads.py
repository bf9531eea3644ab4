"""The native threads of this process, by name (Linux: /proc/self/task/*/comm, 15 characters at most)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

# Ray 2.60's in-process GCS client (the driver of ray.init, the nodes of ray.cluster_utils.Cluster) starts these
# and leaves them running after ray.shutdown() and Cluster.shutdown(), with no Ray object left to stop them.
RAY_CLIENT_THREADS = frozenset({"gcs_client_io_s", "grpc_global_tim", "event_engine", "timer_manager",
                                "default-executo", "resolver-execut"})
# torch.distributed's gloo process groups and the TCPStore server of the default group.
GLOO_THREADS = frozenset({"pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"})


def native_threads() -> collections.Counter:
    """How many threads of this process, besides the main one, run under each name; threads that end while
    read are left out."""
    names = collections.Counter()
    for comm in Path("/proc/self/task").glob("*/comm"):
        if comm.parent.name == str(os.getpid()):  # the main thread's id is the process id
            continue
        try:
            names[comm.read_text().strip()] += 1
        except OSError:
            continue
    return names
