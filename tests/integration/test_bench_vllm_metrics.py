"""bench_vs_vllm's `prefix_hit_tokens`: whether a client's run hit vLLM's prefix cache, read
from a real HTTP server on loopback serving vLLM's counter as vLLM exports it."""
from __future__ import annotations

import http.server
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_vs_vllm import prefix_hit_tokens  # noqa: E402


def test_vllm_prefix_hits_are_read_from_its_metrics_and_absent_elsewhere():
    """`prefix_hit_tokens`, from a real HTTP server on loopback serving vLLM's counter
    (a family with an engine label, a `_created` sample beside `_total`) or no such one."""
    bodies = {"/a/metrics": b"# TYPE vllm:prefix_cache_hits counter\n"
                            b'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4096.0\n'
                            b'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0\n'
                            b'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n',
              "/b/metrics": b"# TYPE applianced_requests counter\napplianced_requests_total 3.0\n"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = bodies.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert prefix_hit_tokens(f"{base}/a") == 4112.0
        assert prefix_hit_tokens(f"{base}/b") is None
        assert prefix_hit_tokens(f"{base}/missing") is None      # 404: an HTTPError
    finally:
        server.shutdown()
        server.server_close()
