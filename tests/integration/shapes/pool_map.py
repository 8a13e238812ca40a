"""A multiprocessing.Pool (fork) mapping work over its workers step after step."""

import hashlib
import multiprocessing as mp

import _shape


def work(job: tuple[int, int]) -> str:
    h = hashlib.sha256(f"{job}".encode())
    for _ in range(3000):
        h = hashlib.sha256(h.digest())
    return h.hexdigest()


if __name__ == "__main__":
    args = _shape.parser(__doc__).parse_args()
    _shape.start("starting a fork Pool of 2")
    total = hashlib.sha256()
    with mp.get_context("fork").Pool(2) as pool:
        for s in range(1, args.steps + 1):
            for r in pool.map(work, [(s, p) for p in range(4)]):
                total.update(r.encode())
            _shape.step(s, args.steps, args.step_seconds)
    _shape.done(total.hexdigest()[:16])
