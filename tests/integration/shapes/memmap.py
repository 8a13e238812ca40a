"""A numpy memory-mapped file (np.memmap, mode w+) holding state that each step reads and rewrites."""

import hashlib

import numpy as np

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--file", required=True)
args = ap.parse_args()
_shape.start(f"mapping {args.file}")
mm = np.memmap(args.file, dtype=np.float64, mode="w+", shape=(1 << 14,))
for s in range(1, args.steps + 1):
    mm[:] = mm * 0.5 + s  # the new state depends on the old one: replaying a step changes the result
    mm.flush()
    _shape.step(s, args.steps, args.step_seconds)
_shape.done(hashlib.sha256(np.asarray(mm).tobytes()).hexdigest()[:16])
