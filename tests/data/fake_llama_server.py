"""A stand-in for llama.cpp's llama-server in tests of `specd bench --llama-server`: the same flags,
/health and a streamed greedy /completion of prompt token ids. Its "speculative" mode (given
--spec-type) answers differently on prompts that start with an odd token, as a peer whose
speculation is not lossless would."""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--host")
parser.add_argument("--spec-type")
args, _ = parser.parse_known_args()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = body["prompt"], body["n_predict"]
        shift = 1 if args.spec_type and prompt[0] % 2 else 0
        tokens = [(prompt[-1] + i + shift) % 200 for i in range(1, n + 1)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, token in enumerate(tokens):
            event = {"content": "x", "tokens": [token], "stop": i == len(tokens) - 1}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args):
        pass


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
