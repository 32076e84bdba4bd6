"""A stand-in runner process: it speaks the runner protocol's /health and /resize on its
socket with sizes a test chooses, so the real server and Runner class can be checked on
memory figures no tiny model has.

    python fake_runner.py SIZES.json -m freetoken.runtime.runner --socket S --spec P ...

SIZES.json maps a model name to {"host", "dense_vram", "expert_bytes", "slots"}; it is read
on every /health (a test edits it, as a VRAM watcher would resize the cache) and /resize
writes the new slot count back.
"""

from __future__ import annotations

import json
import socketserver
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

SIZES = Path(sys.argv[1])
SOCKET = sys.argv[sys.argv.index("--socket") + 1]
NAME = json.loads(Path(sys.argv[sys.argv.index("--spec") + 1]).read_text())["name"]


def info() -> dict:
    m = json.loads(SIZES.read_text())[NAME]
    cache = m["slots"] * m["expert_bytes"]
    vram = m["dense_vram"] + cache
    return {
        "device": "cuda:0",
        "num_ctx": 128,
        "size": m["host"] + vram,
        "size_vram": vram,
        "host_bytes": m["host"],
        "kv_cache_bytes": 0,
        "expert_cache_bytes": cache,
    }


class Handler(BaseHTTPRequestHandler):
    def _send(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"status": "ok", "info": info()})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        sizes = json.loads(SIZES.read_text())
        sizes[NAME]["slots"] = int(body["slots"])
        SIZES.write_text(json.dumps(sizes))
        self._send({"slots": sizes[NAME]["slots"], "bytes": info()["expert_cache_bytes"]})

    def log_message(self, *args):
        pass

    def address_string(self):
        return "runner"


socketserver.UnixStreamServer(SOCKET, Handler).serve_forever()
