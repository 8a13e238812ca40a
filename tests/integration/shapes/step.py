"""The left side of a shell pipeline (``sh -c 'python step.py | tee steps.log'``): steps to stdout."""

import hashlib

import _shape

args = _shape.parser(__doc__).parse_args()
_shape.start("the first stage of a pipeline")
h = hashlib.sha256()
for s in range(1, args.steps + 1):
    h.update(str(s).encode())
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(h.hexdigest()[:16])
