"""A gRPC server with nothing of the sidecar in it, for section 27's ceiling.

`python -m bench.bare_server` serves grpc's own health service from a sync
server with 16 worker threads (as the daemon's `server.max_workers: 16`),
without interceptors, on a free loopback port, which it prints, and serves
until killed. Health checks at 16 in flight against it are the most any
RPC of a Python sync server does on the machine: the ceiling of AddMemory.

Owns: the bare server's process. Must not touch: the sidecar's server or
its wiring (bench.write_groups measures against this one beside the daemon).
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
