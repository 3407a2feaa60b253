"""``pyggml-rpc-server --metrics-port P``: the server's state in Prometheus's text format, at
``http://HOST:P/metrics`` (the server's own address: loopback unless it listens wider).

Served by a thread of its own (the standard library's HTTP server, so the RPC server needs no
web framework), one request at a time, each given REQUEST_TIMEOUT_S: a scraper cannot make it
hold more than one connection.  It reads what the serving loop counts (RPCServer.counters,
its sessions, the devices' memory, the tensor cache) and never changes it.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from .server import RPCServer

REQUEST_TIMEOUT_S = 5.0


def exposition(server: RPCServer) -> str:
    """The metrics as Prometheus's text format (version 0.0.4)."""
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value:.17g}" for labels, value in samples)

    c = server.counters
    sessions = list(server.sessions.values())
    clients = [s for s in sessions if s.writes_into is None]
    metric("pyggml_rpc_sessions", "gauge", "Connections served: clients, and links from other servers",
           [('{kind="client"}', len(clients)), ('{kind="link"}', len(sessions) - len(clients))])
    metric("pyggml_rpc_clients_holding_memory", "gauge", "Clients holding buffers here",
           [("", sum(1 for s in clients if s.buffers))])
    metric("pyggml_rpc_bytes_received_total", "counter", "Bytes of the requests read", [("", c.bytes_in)])
    metric("pyggml_rpc_bytes_sent_total", "counter", "Bytes of the replies sent", [("", c.bytes_out)])
    metric("pyggml_rpc_requests_total", "counter", "Requests served, by command",
           [(f'{{command="{k}"}}', v) for k, v in sorted(dict(c.requests).items())])
    metric("pyggml_rpc_request_seconds_total", "counter", "Seconds the requests took to serve, by command",
           [(f'{{command="{k}"}}', v) for k, v in sorted(dict(c.seconds).items())])
    metric("pyggml_rpc_compute_seconds_total", "counter", "Seconds spent computing graphs", [("", c.compute_s)])
    metric("pyggml_rpc_peer_wait_seconds_total", "counter", "Seconds sessions waited for other servers' tensors",
           [("", c.peer_wait_s)])
    metric("pyggml_rpc_refused_total", "counter", "Requests answered with an error", [("", c.refused)])
    memory = []
    for i, sd in enumerate(server.devices):
        free, total = sd.memory()
        label = f'device="{i}",name="{sd.device.get_name()}"'
        memory += [(f"{{{label},kind=\"free\"}}", free), (f"{{{label},kind=\"total\"}}", total),
                   (f"{{{label},kind=\"used\"}}", sd.used)]
    metric("pyggml_rpc_device_memory_bytes", "gauge", "Each device's memory: free, total (--mem) and used by clients",
           memory)
    if server.cache is not None:
        cache = server.cache
        metric("pyggml_rpc_cache_events_total", "counter", "The tensor cache: hits, misses, stores, evictions",
               [(f'{{event="{k}"}}', getattr(cache, k)) for k in ("hits", "misses", "stores", "evictions")])
        metric("pyggml_rpc_cache_bytes", "gauge", "Bytes the tensor cache holds", [("", cache.size)])
    metric("pyggml_rpc_leaving", "gauge", "1 while the server hands its work over before it exits",
           [("", int(server.leave_deadline is not None))])
    return "\n".join(lines) + "\n"


def serve_metrics(server: RPCServer, host: str, port: int) -> HTTPServer:
    """Start the metrics endpoint on ``host:port`` in a daemon thread; shutdown() stops it."""
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # (the socket's: a client that sends nothing is let go)

        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            for _ in range(3):  # (the serving loop may change a dict while it is read)
                try:
                    body = exposition(server).encode()
                    break
                except RuntimeError:
                    continue
            else:
                self.send_error(503, "busy, try again")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - scraped every few seconds: not logged
            pass

    httpd = HTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="pyggml-rpc-metrics", daemon=True).start()
    return httpd
