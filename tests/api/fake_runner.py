"""A runner that answers at once, for tests of the server's side of every route: started by
a wrapper named in FREETOKEN_RUNNER_PYTHON, it takes the runner's arguments and serves the
runner protocol (docs/architecture.md) on its socket with fixed answers."""

import json
import socketserver
import sys
from http.server import BaseHTTPRequestHandler

ANSWERS = {
    "/health": (200, {"status": "ok", "info": {"num_ctx": 4096}}),
    "/stats": (200, {"status": "ok"}),
    "/tokenize": (200, {"count": 3}),
    "/resize": (400, {"error": "this model has no GPU expert cache"}),
}
DONE = {"done": True, "done_reason": "stop", "prompt_eval_count": 3, "eval_count": 1}


class Runner(BaseHTTPRequestHandler):
    def _send(self, status, body, media="application/json"):
        self.send_response(status)
        self.send_header("content-type", media)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        status, obj = ANSWERS.get(self.path, (404, {"error": "no such route"}))
        self._send(status, json.dumps(obj).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/completion":
            lines = [{"content": "x"}, DONE]
            text = "".join(json.dumps(e) + "\n" for e in lines).encode()
            return self._send(200, text, "application/x-ndjson")
        if self.path == "/embed":
            vectors = [[0.6, 0.8] for _ in body.get("input") or []]
            return self._send(
                200, json.dumps({"embeddings": vectors, "prompt_eval_count": 1}).encode()
            )
        status, obj = ANSWERS.get(self.path, (404, {"error": "no such route"}))
        self._send(status, json.dumps(obj).encode())

    def log_message(self, *args):
        pass

    def address_string(self):
        return "runner"


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


if __name__ == "__main__":
    Server(sys.argv[sys.argv.index("--socket") + 1], Runner).serve_forever()
