"""An open SQLite database written in a loop: each row depends on the one before it."""

import hashlib
import sqlite3

import _shape

ap = _shape.parser(__doc__)
ap.add_argument("--db", required=True)
args = ap.parse_args()
_shape.start(f"opening {args.db}")
db = sqlite3.connect(args.db)
db.execute("CREATE TABLE steps (n INTEGER PRIMARY KEY, h TEXT)")
db.commit()
prev = "seed"
for s in range(1, args.steps + 1):
    prev = hashlib.sha256(f"{prev}:{s}".encode()).hexdigest()
    db.execute("INSERT INTO steps VALUES (?, ?)", (s, prev))
    db.commit()
    _shape.step(s, args.steps, args.step_seconds)
rows = db.execute("SELECT n, h FROM steps ORDER BY n").fetchall()
db.close()
_shape.done(hashlib.sha256(repr(rows).encode()).hexdigest()[:16])
