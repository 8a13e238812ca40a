"""The S3 backend over HTTP against two servers, moto's (a mock in one Python process) and SeaweedFS (a real
S3 server, issue 52): the same contract as the file store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import pytest

from cedana_airflow.config import load_settings
from cedana_airflow.errors import ConditionalWritesIgnored, CorruptCheckpoint, StoreUnavailable
from cedana_airflow.format.manifest import ProcessInfo
from cedana_airflow.store import open_store
from cedana_airflow.store.base import chunk_key
from cedana_airflow.store.transfer import CheckpointMeta, fetch_checkpoint, load_manifests, save_checkpoint

PROC = ProcessInfo(pid=42, command=("train",), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
META = CheckpointMeta(checkpoint_id="job", node="n1", engine_version="4.1.1", process=PROC)


@pytest.fixture(params=["moto", "seaweedfs"])
def bucket(request):
    """Each contract test on both servers: where a real one behaves otherwise than moto, one of them fails."""
    return request.getfixturevalue("moto_bucket" if request.param == "moto" else "seaweed_bucket")


def _images(d: Path, seed: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(seed * (1 << 20))
    (d / "core-1.img").write_bytes(os.urandom(5000))
    return d


def _store(bucket, **settings):
    s = open_store(f"s3://{bucket}/ckpt/team-a", load_settings(settings, environ={}))
    return s, s.open(create=True, chunk_avg_bytes=64 << 10)


def test_round_trip_and_layout_a_person_can_browse(bucket, tmp_path):
    s, cfg = _store(bucket)
    src = _images(tmp_path / "img", os.urandom(3))
    m = save_checkpoint(s, cfg, META, src)
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]}
    assert "ckpt/team-a/store.json" in keys and "ckpt/team-a/job/0000000001/manifest.json" in keys
    assert all(k.startswith("ckpt/team-a/chunks/") for k in keys - {"ckpt/team-a/store.json", "ckpt/team-a/job/0000000001/manifest.json"})
    fetch_checkpoint(s, m, tmp_path / "out")
    for p in src.iterdir():
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()
    assert s.list_ids() == ["job"] and s.list_seqs("job") == [1]


def test_second_checkpoint_uploads_only_new_chunks(bucket, tmp_path):
    s, cfg = _store(bucket)
    src = _images(tmp_path / "img", b"")
    (src / "pages-1.img").write_bytes(os.urandom(4 << 20))  # incompressible, like model weights
    first = save_checkpoint(s, cfg, META, src)
    (src / "core-1.img").write_bytes(os.urandom(5000))  # a small change
    second = save_checkpoint(s, cfg, META, src)
    assert first.stored_bytes > 4 << 20
    assert second.stored_bytes < 0.01 * second.image_bytes and second.new_chunks == 1


def test_a_first_checkpoint_into_an_empty_store_asks_no_per_chunk_questions(bucket, tmp_path):
    s, cfg = _store(bucket)
    heads: list[str] = []
    s.client.meta.events.register("before-call.s3.HeadObject", lambda params, **kw: heads.append(params["url_path"]))
    src = _images(tmp_path / "img", os.urandom(7))
    first = save_checkpoint(s, cfg, META, src)
    assert heads == [] and first.new_chunks == len(first.chunk_digests())
    # A new writer (no chunks known from its own previous checkpoint) into a store that has chunks: it asks.
    second = save_checkpoint(s, cfg, META, src)
    assert len(heads) == len(second.chunk_digests()) and second.new_chunks == 0 and second.stored_bytes == 0
    # A heartbeat knows its previous checkpoint's chunks: what it does not know is new, uploaded without asking.
    heads.clear()
    (src / "core-1.img").write_bytes(os.urandom(5000))
    third = save_checkpoint(s, cfg, META, src, known_digests=second.chunk_digests())
    assert heads == [] and third.new_chunks == 1
    fetch_checkpoint(s, third, tmp_path / "out")
    assert (tmp_path / "out" / "core-1.img").read_bytes() == (src / "core-1.img").read_bytes()


def test_manifests_are_create_only(bucket, tmp_path):
    s, cfg = _store(bucket)
    m = save_checkpoint(s, cfg, META, _images(tmp_path / "img", b"x"))
    assert s.put_manifest("job", 1, b"{}") is False
    assert load_manifests(s, "job") == [m]


def _proxied(monkeypatch):
    """A fault proxy in front of the endpoint the bucket fixture chose; boto3 pointed at it."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "faults"))
    from s3_faults import FaultProxy

    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy


def test_a_conditional_put_whose_answer_was_lost_is_the_writer_s_own_not_a_lost_race(bucket, tmp_path, monkeypatch):
    """The server applied the manifest's create-only PUT; its answer was lost (a reset); botocore tried again
    and met 412, its own write. That is a commit, not another writer's: before, the heartbeat took its own
    manifest for a rival's. The same for the index's compare-and-swap."""
    proxy = _proxied(monkeypatch)
    try:
        from s3_faults import Rule

        s, cfg = _store(bucket, s3_conditional_writes="trust")  # no probe through the proxy's faults
        proxy.arm(Rule("PUT", r"/job/0000000001/manifest\.json", "lost", times=1))
        m = save_checkpoint(s, cfg, META, _images(tmp_path / "img", b"x"))
        assert proxy.rule is not None and proxy.rule.hits == 1  # the first try's answer was lost
        assert [x.seq for x in load_manifests(s, "job")] == [1] and m.seq == 1
        # a rival's manifest at seq 1 is still a lost race, retry or not: the read-back tells them apart
        proxy.arm(Rule("PUT", r"/job/0000000001/manifest\.json", "lost", times=1))
        assert s.put_manifest("job", 1, b'{"a rival": 1}') is False
        assert load_manifests(s, "job") == [m]
        # compare-and-swap: the swap applied, its answer lost, the retry's 412 is ours
        assert s.put_if_version("scratch", b"one", "") is True
        token = s.get_versioned("scratch")[1]
        proxy.arm(Rule("PUT", r"/scratch$", "lost", times=1))
        assert s.put_if_version("scratch", b"two", token) is True and s.get("scratch") == b"two"
        assert s.put_if_version("scratch", b"three", token) is False  # a stale token still loses
        # the applied try's answer lost, botocore's retry met it in flight (409, which botocore does not retry),
        # the store's next try met it done (412, not a retry of botocore's): still our own write
        proxy.arm(Rule("PUT", r"/job/0000000002/manifest\.json", "lost+409", times=2))
        assert s.put_manifest("job", 2, b'{"ours": 2}') is True and proxy.rule.hits == 2
    finally:
        proxy.close()


def test_a_conditional_put_met_by_another_write_in_flight_is_tried_again(bucket, monkeypatch):
    """AWS answers 409 ConditionalRequestConflict while another conditional write to the key is in flight:
    its outcome is not known yet. A few tries, then a lost race (before: lost at once, where nobody may win)."""
    proxy = _proxied(monkeypatch)
    try:
        from s3_faults import Rule

        s, _ = _store(bucket, s3_conditional_writes="trust")
        proxy.arm(Rule("PUT", r"/locks/held$", "409", times=2))
        assert s.put_if_absent("locks/held", b"mine") is True and s.get("locks/held") == b"mine"
        proxy.arm(Rule("PUT", r"/locks/other$", "409", times=100))  # the rival's write never settles here
        assert s.put_if_absent("locks/other", b"mine") is False and s.get("locks/other") is None
    finally:
        proxy.close()


def test_a_deleted_checkpoint_id_leaves_the_store_s_ids(bucket, tmp_path):
    """SeaweedFS keeps the folders a delete empties, and lists them (moto and AWS keep no folders): every
    finished task's ID stayed among the store's IDs, for gc, check and the agent's listing to walk."""
    import dataclasses
    from datetime import datetime, timezone

    from cedana_airflow.store.gc import delete_checkpoint_id
    from cedana_airflow.store.restores import RestoreRecord, record_restore

    s, cfg = _store(bucket)
    assert s.keeps_folders is bucket.startswith("sw-")  # the probe saw SeaweedFS keep its emptied folder
    save_checkpoint(s, cfg, META, _images(tmp_path / "a", b"a"))
    save_checkpoint(s, cfg, dataclasses.replace(META, parent_seq=1), _images(tmp_path / "b", b"b"))
    save_checkpoint(s, cfg, dataclasses.replace(META, checkpoint_id="kept"), _images(tmp_path / "c", b"c"))
    record_restore(s, RestoreRecord(checkpoint_id="job", outcome="restored", seq=1, at=datetime.now(timezone.utc)))
    assert s.list_ids() == ["job", "kept"] and s.list_seqs("job") == [1, 2]
    delete_checkpoint_id(s, "job", [1])  # a folder that still holds a checkpoint stays
    assert s.list_ids() == ["job", "kept"] and s.list_seqs("job") == [2]
    delete_checkpoint_id(s, "job")
    assert s.list_ids() == ["kept"] and s.list_seqs("job") == [] and s.list_seqs("kept") == [1]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_chunk_objects_are_refused(bucket, tmp_path, damage):
    s, cfg = _store(bucket)
    m = save_checkpoint(s, cfg, META, _images(tmp_path / "img", os.urandom(7)))
    key = "ckpt/team-a/" + chunk_key(m.files[-1].chunks[0].digest)
    c = boto3.client("s3")
    body = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    if damage == "delete":
        c.delete_object(Bucket=bucket, Key=key)
    else:
        if damage == "flip":
            body[len(body) // 2] ^= 1
        else:
            del body[-100:]
        c.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(CorruptCheckpoint, match="missing" if damage == "delete" else "seq=1"):
        fetch_checkpoint(s, m, tmp_path / "out")


def test_server_side_encryption_is_requested_on_every_object(bucket, tmp_path):
    s, cfg = _store(bucket, s3_sse="AES256")
    save_checkpoint(s, cfg, META, _images(tmp_path / "img", b"e"))
    c = boto3.client("s3")
    for o in c.list_objects_v2(Bucket=bucket, Prefix="ckpt/team-a/chunks/")["Contents"] + \
            c.list_objects_v2(Bucket=bucket, Prefix="ckpt/team-a/job/")["Contents"]:
        assert c.head_object(Bucket=bucket, Key=o["Key"])["ServerSideEncryption"] == "AES256"


def test_missing_bucket_is_one_clear_line(s3_env):
    s = open_store("s3://no-such-bucket-here/x", load_settings(environ={}))
    with pytest.raises(StoreUnavailable, match=r"bucket 'no-such-bucket-here' does not exist at http://127\.0\.0\.1:\d+\. Create it"):
        s.open(create=True, chunk_avg_bytes=1 << 20)


def test_unreachable_endpoint_is_one_clear_line(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s = open_store("s3://any-bucket/x", load_settings(environ={}))
    with pytest.raises(StoreUnavailable, match=r"endpoint http://127\.0\.0\.1:9 is unreachable\. Check AWS_ENDPOINT_URL"):
        s.open(create=True, chunk_avg_bytes=1 << 20)


def test_an_endpoint_with_userinfo_is_masked_in_messages(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:s3cr3t-value@127.0.0.1:9")  # nothing listens on 9
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s = open_store("s3://any-bucket/x", load_settings(environ={}))
    with pytest.raises(StoreUnavailable) as e:
        s.open(create=True, chunk_avg_bytes=1 << 20)
    assert "s3cr3t-value" not in str(e.value) and "http://***@127.0.0.1:9" in str(e.value)


def test_credentials_never_reach_a_message(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    for url in ("s3://user:s3cr3t-value@bucket/x", "s3://UPPER/x", "s3://b/../x"):
        with pytest.raises(Exception) as e:
            open_store(url, load_settings(environ={}))
        assert "s3cr3t-value" not in str(e.value) and "s3://bucket/prefix" in str(e.value)


def test_kms_key_without_kms_is_a_config_error():
    from cedana_airflow.errors import ConfigError

    with pytest.raises(ConfigError, match="s3_sse_kms_key_id is set but s3_sse is not 'aws:kms'"):
        load_settings({"s3_sse_kms_key_id": "arn:aws:kms:us-east-1:1:key/x"}, environ={})


def test_wrong_credentials_are_one_clear_line_without_the_secret(tmp_path):
    from conftest import cli, cli_env, moto_server

    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as endpoint:  # this one checks every request's credentials
        env = cli_env(tmp_path, "n", "w", CEDANA_STORE="s3://some-bucket/x", AWS_ENDPOINT_URL=endpoint,
                      AWS_ACCESS_KEY_ID="AKIANOTAREALKEY00000", AWS_SECRET_ACCESS_KEY="wrong-secret-4711",
                      AWS_DEFAULT_REGION="us-east-1")
        r = cli("checkpoints", env=env)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("StoreUnavailable: store s3://some-bucket/x/: checking the bucket was refused (403)")
    assert "Check the credentials" in lines[0]
    assert "wrong-secret-4711" not in r.stderr + r.stdout and "AKIANOTAREALKEY00000" not in r.stderr + r.stdout


def test_credentials_from_a_mounted_secret_directory_and_one_line_when_a_key_is_missing(tmp_path, moto_bucket,
                                                                                        s3_endpoint):
    bucket = moto_bucket
    from conftest import cli, cli_env

    secret = tmp_path / "secret"  # a Kubernetes Secret as a volume: one file per key
    secret.mkdir()
    (secret / "AWS_ACCESS_KEY_ID").write_text("from-the-file\n")
    (secret / "AWS_ENDPOINT_URL").write_text(s3_endpoint)
    (secret / "AWS_REGION").write_text("us-east-1")
    env = {k: v for k, v in cli_env(tmp_path, "n", "w", CEDANA_STORE=f"s3://{bucket}/x").items() if not k.startswith("AWS_")}
    env["CEDANA_STORE_CREDENTIALS_DIR"] = str(secret)
    r = cli("checkpoints", env=env)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"StoreUnavailable: store credentials dir {secret} has no AWS_SECRET_ACCESS_KEY file. Give the Secret those "
        "keys, or unset store_credentials_dir to use the standard credential chain.")
    (secret / "AWS_SECRET_ACCESS_KEY").write_text("also-from-the-file")
    r = cli("checkpoints", env=env)  # no AWS_* in the environment: without the files botocore has no credentials
    assert r.returncode == 0, r.stderr


def test_a_server_that_ignores_conditional_writes_is_refused_in_one_line_before_the_first_write(moto_bucket,
                                                                                                s3_endpoint, monkeypatch):
    """The store's safety rests on create-only manifests and compare-and-swap index writes (issue 52): a gateway
    that drops If-None-Match and If-Match would let two writers both win, silently. The writer's first open
    probes a scratch key and refuses such a server, naming it and the setting; `trust` skips the probe."""
    from cedana_airflow.store import s3 as s3_store

    bucket = moto_bucket
    monkeypatch.setattr(s3_store, "_PROBED", {})
    s, _ = _store(bucket)  # moto honours both: probed and passed
    assert f"at {s3_endpoint} honours create-only and compare-and-swap PUTs, 4 writers racing" in \
        s.probe_conditional_writes()
    proxy = _proxied(monkeypatch)
    proxy.drop_headers = {"if-none-match", "if-match"}
    try:
        with pytest.raises(StoreUnavailable) as e:
            _store(bucket)
        line = str(e.value)
        assert "\n" not in line and f"the S3 server at {proxy.url} (" in line and "does not honour conditional" in line
        assert "4 of 4 concurrent create-only PUTs (If-None-Match: *) of one new key succeeded" in line
        assert "a PUT with a stale If-Match succeeded" in line and "s3_conditional_writes = trust" in line
        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)
                .get("Contents", [])]
        assert not [k for k in keys if "/locks/probe-" in k], keys  # the scratch key is gone
        trusted, _ = _store(bucket, s3_conditional_writes="trust")  # the operator's choice, at their risk
        assert trusted.list_ids() == []
        reader = open_store(f"s3://{bucket}/ckpt/team-a", load_settings({}, environ={}))  # through the gateway
        assert reader.open(create=False, chunk_avg_bytes=64 << 10)  # a reader never probes: nothing it writes
    finally:
        proxy.close()


def test_a_real_s3_server_honours_the_conditional_writes_the_store_rests_on(seaweed_bucket):
    s, _ = _store(seaweed_bucket)  # a writer's open probes it
    said = s.probe_conditional_writes()
    assert "honours create-only and compare-and-swap PUTs" in said and "SeaweedFS" in said, said


def test_doctor_probe_store_says_whether_the_server_honours_conditional_writes(tmp_path, seaweed_bucket, seaweed_env):
    from conftest import cli, cli_env

    env = cli_env(tmp_path, "n", "w", CEDANA_STORE=f"s3://{seaweed_bucket}/ckpt", **seaweed_env)
    checks = {c["name"]: c for c in json.loads(cli("doctor", "--json", "--probe-store", env=env).stdout)}
    store = checks["store"]
    assert store["status"] == "ok" and "honours create-only and compare-and-swap PUTs" in store["detail"], store
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=seaweed_bucket).get("Contents", [])]
    assert keys == ["ckpt/store.json"], keys  # what it said it wrote, and no scratch key left


class _Stub:
    """An S3 client that answers 412 to every If-Match PUT, even the one with the current ETag: one that
    checks the header but never lets a compare-and-swap through (the index and the leases would stall)."""

    class meta:  # noqa: N801 (botocore's attribute)
        endpoint_url = "http://stub.invalid:9000"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_object(self, Bucket: str, Key: str, Body: bytes, **kw: str) -> dict:  # noqa: N803 (botocore's names)
        from botocore.exceptions import ClientError

        if ("IfNoneMatch" in kw and Key in self.objects) or "IfMatch" in kw:
            raise ClientError({"Error": {"Code": "PreconditionFailed"}, "ResponseMetadata": {}}, "PutObject")
        self.objects[Key] = Body
        return {"ResponseMetadata": {"HTTPHeaders": {"server": "Stub\x1b[31m"}}}

    def get_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803
        import io

        return {"Body": io.BytesIO(self.objects[Key]), "ETag": '"e"'}

    def delete_object(self, Bucket: str, Key: str) -> None:  # noqa: N803
        self.objects.pop(Key, None)

    def list_objects_v2(self, Bucket: str, Prefix: str, Delimiter: str) -> dict:  # noqa: N803
        return {"Contents": [{"Key": k} for k in self.objects if k.startswith(Prefix)]}


def test_a_server_that_never_lets_a_compare_and_swap_through_is_refused_too():
    from cedana_airflow.store.s3 import S3Store

    stub = _Stub()
    store = S3Store("b", "p", stub, load_settings({}, environ={}))
    with pytest.raises(StoreUnavailable, match=r"\(Stub\[31m\) does not honour conditional writes: a PUT with the "
                                               r"current If-Match was refused"):
        store.probe_conditional_writes()
    assert stub.objects == {}  # the scratch key is gone


def test_a_process_probes_a_server_once_an_hour_and_again_through_another_proxy(monkeypatch):
    """A supervisor opens its store at every heartbeat: one probe, not one per heartbeat. The node agent
    lives for weeks: the server behind its endpoint may be replaced, so the answer lasts an hour. A client
    through another proxy may reach another server."""
    from types import SimpleNamespace

    from cedana_airflow.store import s3 as s3_store

    probes: list[str] = []
    monkeypatch.setattr(s3_store, "_PROBED", {})
    monkeypatch.setattr(s3_store.S3Store, "probe_conditional_writes", lambda self: probes.append(self.bucket) or "ok")
    now = [1000.0]
    monkeypatch.setattr(s3_store, "_clock", lambda: now[0])

    def store(proxies: dict[str, str] | None = None) -> s3_store.S3Store:
        client = SimpleNamespace(meta=SimpleNamespace(endpoint_url="http://s3.invalid",
                                                      config=SimpleNamespace(proxies=proxies)))
        return s3_store.S3Store("b", "p", client, load_settings({}, environ={}))

    s3_store._probe_once(store())
    s3_store._probe_once(store())
    assert len(probes) == 1
    now[0] += 3599
    s3_store._probe_once(store())
    assert len(probes) == 1
    now[0] += 2
    s3_store._probe_once(store())
    assert len(probes) == 2
    s3_store._probe_once(store({"https": "http://proxy.invalid:3128"}))
    assert len(probes) == 3

    # an hour on, a re-probe that fails on the way keeps the last verdict (a write is not failed by it) ...
    def flaky(self):
        probes.append("flaky")
        raise StoreUnavailable("store s3://b/p/: probing conditional writes failed (SlowDown) at http://s3.invalid")

    monkeypatch.setattr(s3_store.S3Store, "probe_conditional_writes", flaky)
    now[0] += 3601
    s3_store._probe_once(store())
    s3_store._probe_once(store())  # ... and is tried again in five minutes, not at every write
    assert probes[3:] == ["flaky"]
    now[0] += 301
    # ... where a server found ignoring conditional writes is refused at once
    monkeypatch.setattr(s3_store.S3Store, "probe_conditional_writes",
                        lambda self: (_ for _ in ()).throw(ConditionalWritesIgnored("ignores them")))
    with pytest.raises(ConditionalWritesIgnored):
        s3_store._probe_once(store())
    # a first probe that fails is an error: nothing is known of the server yet
    monkeypatch.setattr(s3_store.S3Store, "probe_conditional_writes", flaky)
    with pytest.raises(StoreUnavailable):
        s3_store._probe_once(store({"https": "http://other.invalid:3128"}))


def test_the_threads_of_a_process_wait_for_one_probe(monkeypatch):
    import threading
    import time
    from types import SimpleNamespace

    from cedana_airflow.store import s3 as s3_store

    probes: list[int] = []
    monkeypatch.setattr(s3_store, "_PROBED", {})
    monkeypatch.setattr(s3_store.S3Store, "probe_conditional_writes",
                        lambda self: probes.append(1) or time.sleep(0.3) or "ok")
    client = SimpleNamespace(meta=SimpleNamespace(endpoint_url="http://s3.invalid", config=SimpleNamespace(proxies=None)))
    stores = [s3_store.S3Store("b", "p", client, load_settings({}, environ={})) for _ in range(4)]
    threads = [threading.Thread(target=s3_store._probe_once, args=(st,)) for st in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert probes == [1]


def test_a_folder_the_server_will_not_delete_never_fails_the_delete_that_emptied_it():
    """Removing an emptied folder is best effort: a server that refuses it (a prefix-scoped policy, a filer's
    error) must not fail a prune after its commit (review of issue 52, F4)."""
    from botocore.exceptions import ClientError

    from cedana_airflow.format.layout import manifest_key
    from cedana_airflow.store.s3 import S3Store

    class Refusing(_Stub):
        deleted: list[str] = []

        def delete_object(self, Bucket: str, Key: str) -> None:  # noqa: N803
            if Key.endswith("/"):
                raise ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {}}, "DeleteObject")
            self.deleted.append(Key)
            super().delete_object(Bucket, Key)

    stub = Refusing()
    store = S3Store("b", "p", stub, load_settings({"s3_conditional_writes": "trust"}, environ={}))
    store.keeps_folders = True
    store.delete(manifest_key("job", 1))
    assert stub.deleted == ["p/job/0000000001/manifest.json"]
