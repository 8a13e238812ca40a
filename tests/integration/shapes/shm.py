"""POSIX shared memory (multiprocessing.shared_memory, i.e. a file in /dev/shm) holding the state
a step reads and rewrites."""

import hashlib
from multiprocessing import shared_memory

import _shape

args = _shape.parser(__doc__).parse_args()
_shape.start("creating a shared memory block")
seg = shared_memory.SharedMemory(create=True, size=1 << 16)
print(f"segment /dev/shm/{seg.name}", flush=True)
try:
    for s in range(1, args.steps + 1):
        prev = bytes(seg.buf[(s - 1) % 2048 * 32:(s - 1) % 2048 * 32 + 32])
        seg.buf[s % 2048 * 32:s % 2048 * 32 + 32] = hashlib.sha256(prev + str(s).encode()).digest()
        _shape.step(s, args.steps, args.step_seconds)
    _shape.done(hashlib.sha256(bytes(seg.buf)).hexdigest()[:16])
finally:
    seg.close()
    seg.unlink()
