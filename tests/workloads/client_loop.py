"""A workload holding one long-lived client of a service outside its tree, as jobs do (a requests Session,
a boto3 client, a psycopg2 connection, a redis-py client): each step makes one call through it. A call
that fails is said in one line and not retried here: what a restore shows is what the library does by
itself. Prints ``call i`` as each call begins (so a test can tell a call the checkpoint caught in flight from one
begun after the restore), then ``step i ok`` or ``step i failed: <exception>``."""

import argparse
import time

ap = argparse.ArgumentParser()
ap.add_argument("--client", choices=["requests", "boto3", "psycopg2", "redis"], required=True)
ap.add_argument("--url", required=True)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--step-seconds", type=float, default=0.1)
a = ap.parse_args()

if a.client == "requests":
    import requests

    session = requests.Session()

    def call() -> None:
        session.get(a.url, timeout=5).raise_for_status()
elif a.client == "boto3":
    import boto3

    s3 = boto3.client("s3", endpoint_url=a.url, region_name="us-east-1", aws_access_key_id="k",
                      aws_secret_access_key="s")
    s3.create_bucket(Bucket="clients")

    def call() -> None:
        s3.head_bucket(Bucket="clients")
elif a.client == "psycopg2":
    import psycopg2

    conn = psycopg2.connect(a.url)
    conn.autocommit = True

    def call() -> None:
        with conn.cursor() as cur:
            cur.execute("select 1")
            cur.fetchone()
else:
    import redis

    r = redis.Redis.from_url(a.url)

    def call() -> None:
        r.incr("steps")

print(f"start-up: {a.client} client of {a.url}", flush=True)
for i in range(1, a.steps + 1):
    print(f"call {i}", flush=True)
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what the library raised is the finding
        print(f"step {i} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    else:
        print(f"step {i} ok", flush=True)
    time.sleep(a.step_seconds)
print("done", flush=True)
