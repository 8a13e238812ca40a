"""A job that uses a credential it was given in its environment (MY_API_TOKEN) at every step, and
says whether the store's own credential (AWS_SECRET_ACCESS_KEY) is visible to it."""

import hashlib
import os

import _shape

args = _shape.parser(__doc__).parse_args()
_shape.start("reading MY_API_TOKEN")
print(f"store secret visible: {os.environ.get('AWS_SECRET_ACCESS_KEY') is not None}", flush=True)
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    h.update(os.environ["MY_API_TOKEN"].encode() + str(s).encode())  # a KeyError if it were lost
    _shape.step(s, args.steps, args.step_seconds)
print(f"token sha256={hashlib.sha256(os.environ['MY_API_TOKEN'].encode()).hexdigest()[:12]}", flush=True)
print(f"store secret visible: {os.environ.get('AWS_SECRET_ACCESS_KEY') is not None}", flush=True)
_shape.done(h.hexdigest()[:16])
