"""A serving worker as people write one: an HTTP server holding its state in memory (here a request
counter; in life a model and its caches), on all addresses of its node. ``GET /`` answers ``hits N``;
``GET /quit`` answers ``bye after N`` and ends the server (exit 0), as a drain would."""

import argparse
import http.server
import threading

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
args = ap.parse_args()
hits = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's connection stays open between requests

    def do_GET(self) -> None:
        global hits
        quitting = self.path == "/quit"
        if quitting:
            body = f"bye after {hits}\n".encode()
        else:
            hits += 1
            body = f"hits {hits}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if quitting:  # after the answer is out: the server's threads die with the process
            threading.Thread(target=server.shutdown).start()

    def log_message(self, *a: object) -> None:
        pass


server = http.server.ThreadingHTTPServer(("0.0.0.0", args.port), Handler)
print("serving", flush=True)
server.serve_forever()
print(f"served {hits}", flush=True)
